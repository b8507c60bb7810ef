"""batchprefill: offline batch LLM inference that computes every shared prompt prefix once.

From Python: `batchprefill.run(data, **config)`, `batchprefill.Runner(**config)` and `batchprefill.plan(data,
**config)` (batchprefill.api). They load on first use, so `import batchprefill` stays cheap (no torch, polars or
Hydra until a job starts).

`batchprefill.run` and `batchprefill.plan` name the functions, while `python -m batchprefill.run` and `-m
batchprefill.plan` run the shims of the same names (INTERFACE.md): runpy executes a shim as `__main__` without
binding it here. Nothing imports them as modules (tests/test_api.py checks): `import batchprefill.run` would
rebind `batchprefill.run` to the shim.
"""

from batchprefill.errors import JobError

__version__ = "0.1.0"
__all__ = ["JobError", "Result", "Runner", "plan", "run"]

_API_NAMES = ("Result", "Runner", "plan", "run")


def __getattr__(name: str) -> object:
    """The API's names, imported from batchprefill.api when first asked for."""
    if name in _API_NAMES:
        from batchprefill import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchprefill' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API_NAMES})
