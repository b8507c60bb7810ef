"""`batchprefill-eval`: lm-evaluation-harness's own command line, with the `batchprefill` model registered.

    batchprefill-eval --model batchprefill --model_args pretrained=PATH,dtype=float32 --tasks ... [lm-eval flags]
"""

from __future__ import annotations

from batchprefill.cli.app import reported_errors


def main() -> None:
    with reported_errors("batchprefill-eval"):
        from lm_eval.__main__ import cli_evaluate

        import batchprefill.integrations.lm_eval  # noqa: F401 - registers the model `batchprefill`
        cli_evaluate()


if __name__ == "__main__":
    main()
