"""Every config key and the one type it takes: the whole configuration's schema, checked once at parse time.

Hydra composes `conf/config.yaml` with the overrides (the command line's, or the Python API's keyword arguments
written as overrides), and `check_config` walks the result against `KEYS` before settings.py reads a value: a
value of the wrong type, a boolean written other than YAML's true/false, a key no one defined, or a required key
left unset ends the job in one line naming the key and what it accepts (JobError: exit 2 on the command line, the
exception from Python). Every command (run, plan, merge) and the Python API go through it, because settings.py's
`JobSettings.from_config` calls it first.

Ranges and what one key means beside another (max_tokens >= 1, a power-of-two block size, a task's columns) stay
in settings.py, which reads values this module has already typed.

Adding a key is one line in `KEYS` (and its default in conf/config.yaml), e.g.

    "model.quantization": choice("fp8", nullable=True),

OmegaConf's structured configs were not used because they type a key with one Python type (or Optional): a key
that takes a positive integer or the word `auto` (engine.max_num_seqs) has no such type.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from batchprefill.errors import JobError
from batchprefill.model.quantization import QUANTIZATIONS
from batchprefill.pooling_params import POOLINGS
from batchprefill.units import a_type


@dataclass(frozen=True)
class Kind:
    """What one key accepts: `accepts` says it in words for the error line, `fits` checks a plain Python value (null
    is allowed only when `nullable`), and `wrong` is a value of another type, for the tests that walk the schema."""

    accepts: str
    fits: Callable[[object], bool]
    wrong: object
    nullable: bool = False
    open_mapping: bool = False  # a mapping whose keys the user names (model.adapters.NAME): not walked into
    choices: tuple[str, ...] = ()  # a word out of a list: a string not in it is told to choose

    def words(self) -> str:
        return f"{self.accepts} or null" if self.nullable else self.accepts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_strings(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value))


def integer(nullable: bool = False) -> Kind:
    return Kind("an integer", _is_int, "four", nullable)


def number(nullable: bool = False) -> Kind:
    return Kind("a number", _is_number, "four", nullable)


def integer_or_auto() -> Kind:
    return Kind("an integer or auto", lambda v: _is_int(v) or v == "auto", "four")


def boolean() -> Kind:
    return Kind("true or false", lambda v: isinstance(v, bool), "maybe")


def text(nullable: bool = False) -> Kind:
    return Kind("a string", lambda v: isinstance(v, str), 5, nullable)


def choice(*values: str, nullable: bool = False) -> Kind:
    *first, last = values
    words = f"{', '.join(first)} or {last}" if first else last
    return Kind(words, lambda v: isinstance(v, str) and v in values, 5, nullable, choices=values)


def strings(nullable: bool = False) -> Kind:
    """One string (taken as a list of one) or a list of strings: sampling.stop, sampling.choice."""
    return Kind("a string or a list of strings", _is_strings, 5, nullable)


def named_folders() -> Kind:
    return Kind("a mapping of names to folders (+model.adapters.NAME=/path)",
                lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()), 5, open_mapping=True)


KEYS: dict[str, Kind] = {
    "task": text(),  # the task registry (tasks/__init__.py) checks the name
    "data.input": text(nullable=True),
    "data.format": text(),  # the format registry (io/formats.py) checks the name
    "data.prompt_column": text(),
    "data.system_column": text(nullable=True),
    "data.id_column": text(),
    "data.namespace_column": text(nullable=True),
    "data.adapter_column": text(nullable=True),
    "data.chat_template": boolean(),
    "data.messages_column": text(nullable=True),
    "data.choices_column": text(nullable=True),
    "data.schema_column": text(nullable=True),
    "data.order": choice("prefix", "input"),
    "data.num_shards": integer(nullable=True),
    "data.shard_index": integer(nullable=True),
    "data.read_batch_rows": integer(),
    "data.buffer_mb": integer(),
    "model.name": text(),
    "model.path": text(nullable=True),
    "model.dtype": choice("auto", "float32", "bfloat16", "float16"),
    "model.adapters": named_folders(),
    "model.pooling": choice(*POOLINGS),
    "model.normalize": boolean(),
    "model.quantization": choice(*QUANTIZATIONS, nullable=True),
    "engine.device": choice("auto", "cpu", "cuda"),
    "engine.attention_backend": choice("auto", "torch", "triton"),
    "engine.block_size": integer(),
    "engine.max_batched_tokens": integer_or_auto(),
    "engine.max_num_seqs": integer_or_auto(),
    "engine.kv_cache_tokens": integer(nullable=True),
    "engine.prefix_caching": boolean(),
    "engine.kv_cache_dtype": choice("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "engine.cache_namespace": text(),
    "engine.reserve_output_blocks": boolean(),
    "engine.num_threads": integer(nullable=True),
    "engine.cuda_graphs": boolean(),
    "engine.batch_invariant": boolean(),
    "sampling.max_tokens": integer(),
    "sampling.temperature": number(),
    "sampling.top_p": number(),
    "sampling.top_k": integer(),
    "sampling.seed": integer(),
    "sampling.stop": strings(),
    "sampling.ignore_eos": boolean(),
    "sampling.n": integer(),
    "sampling.logprobs": integer(nullable=True),
    "sampling.json_schema": text(nullable=True),
    "sampling.regex": text(nullable=True),
    "sampling.choice": strings(nullable=True),
    "output.dir": text(),
    "output.resume": boolean(),
    "output.commit_every_rows": integer(),
    "output.commit_every_seconds": number(),
    "output.progress": boolean(),
    "output.plot": boolean(),
    "output.lease_seconds": number(),
    "plan.link_gbps": number(),
    "plan.device_memory_gb": number(nullable=True),
}


def check_config(cfg: DictConfig) -> None:
    """Every key of `cfg` is one of KEYS and holds a value of its type; else a one-line JobError naming it."""
    for key in _leaf_keys(cfg, ""):
        section = [name for name in KEYS if name.startswith(f"{key}.")]
        if section:
            raise JobError(f"{key} is a section, not a key: give its keys, e.g. {section[0]}=..., "
                           f"one of {', '.join(section)}")
        if key not in KEYS:
            raise JobError(unknown_key_message(key))
    for key, kind in KEYS.items():
        try:
            node = OmegaConf.select(cfg, key, throw_on_missing=True)
        except MissingMandatoryValue:
            raise JobError(f"{key} is not set: give it a value ({key}=...), {kind.words()}") from None
        value = OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
        if not (value is None and kind.nullable) and not kind.fits(value):
            raise JobError(wrong_type_message(key, value))


def wrong_type_message(key: str, value: object) -> str:
    """The line for a value the key does not take: the key and value as given, and what the key accepts."""
    kind = KEYS[key]
    shown = repr(value) if value == "" or isinstance(value, str) and value.strip() != value else _shown(value)
    if kind.choices and isinstance(value, str):
        return f"{key}={shown}: choose {kind.words()}"
    quote = f" (quote it to make it a string: {key}=\"'{shown}'\")" if kind.accepts == "a string" and \
        _is_number(value) else ""
    return f"{key}={shown} is {_type_name(value)}: give {kind.words()}{quote}"


def unknown_key_message(key: str) -> str:
    """The line for a key no one defined (a typo, or one added with `+`): the keys nearest to it, else its
    section's keys."""
    section, _, name = key.rpartition(".")
    siblings = {known.rpartition(".")[2]: known for known in KEYS if known.rpartition(".")[0] == section}
    near = [siblings[match] for match in difflib.get_close_matches(name, siblings, n=2, cutoff=0.7)] or \
        difflib.get_close_matches(key, KEYS, n=2, cutoff=0.85)
    if near:
        return f"{key} is not a config key: did you mean {' or '.join(near)}?"
    section = [name for name in KEYS if name.split(".")[0] == key.split(".")[0]]
    known = f"the {key.split('.')[0]} keys are {', '.join(section)}" if section else \
        f"the sections are {', '.join(dict.fromkeys(name.split('.')[0] for name in KEYS))}"
    return f"{key} is not a config key: {known}"


def _leaf_keys(node: DictConfig, prefix: str) -> Iterator[str]:
    for name in node:
        key = f"{prefix}{name}"
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not (key in KEYS and KEYS[key].open_mapping):
            yield from _leaf_keys(child, f"{key}.")
        else:
            yield key


def _shown(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return a_type(value)
