"""Structured outputs: token masks that keep every sampled token inside a JSON Schema, a regex or a choice list.

xgrammar does the work (picked over llguidance in BENCHMARKS.md, "Grammar engines"): each distinct constraint
is compiled once per job, each constrained request walks its own matcher, and each step the masks of the whole
batch are filled by one multi-threaded call into one preallocated bitmask, then applied to the logits in one
op. Constraints touch sampling only: prefill, the prefix cache and raw logprobs are untouched.

When a grammar is complete its mask allows only the model's EOS tokens, so a constrained request ends the
usual way, on EOS (finish_reason `stop`); a request cut by max_tokens ends with `length` and an unfinished
document, as in OpenAI's API.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar

from batchprefill.model.tokenizer import PromptTokenizer

KINDS = ("json_schema", "json_object", "regex", "choice")
# xgrammar prefixes its errors with a timestamp and its C++ source line: "[19:54:38] /project/cpp/x.cc:94: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/-")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message goes into the request's error row."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match, in a canonical text form so equal constraints share one compile."""

    kind: str
    spec: str = ""

    @staticmethod
    def json_schema(schema: str | dict) -> Constraint:
        """A JSON Schema given as a dict or a JSON string; keys are sorted, so formatting never recompiles."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise GrammarError(f"json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, not {type(schema).__name__}")
        return Constraint("json_schema", json.dumps(schema, sort_keys=True))

    @staticmethod
    def json_object() -> Constraint:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex must be a non-empty string")
        return Constraint("regex", pattern)

    @staticmethod
    def choice(options: Sequence[str]) -> Constraint:
        options = list(options) if not isinstance(options, str) else [options]
        if not options or not all(isinstance(option, str) and option for option in options):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return Constraint("choice", json.dumps(options))

    @staticmethod
    def from_response_format(response_format: dict | None) -> Constraint | None:
        """OpenAI's `response_format`: `text` (or none) is unconstrained; `json_object` and `json_schema` are."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise GrammarError("response_format must be an object")
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, dict) or "schema" not in body:
                raise GrammarError("response_format json_schema needs json_schema.schema")
            return Constraint.json_schema(body["schema"])
        raise GrammarError(f"response_format type {kind!r}: choose text, json_object or json_schema")


def job_constraint(json_schema: str | None, regex: str | None, choice: Sequence[str] | None) -> Constraint | None:
    """The job-wide constraint of `sampling.json_schema` (a `.json` path or inline JSON), `sampling.regex` or
    `sampling.choice`; at most one may be set. Raises GrammarError, which the entry point turns into a JobError.
    """
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
             if value is not None]
    if len(given) > 1:
        raise GrammarError(f"sampling.{' and sampling.'.join(given)} are both set: choose one constraint")
    if json_schema is not None:
        path = Path(json_schema).expanduser()
        if path.suffix == ".json":
            if not path.is_file():
                raise GrammarError(f"sampling.json_schema file {path} does not exist")
            json_schema = path.read_text()
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint.regex(regex)
    if choice is not None:
        return Constraint.choice(choice)
    return None


class Grammars:
    """The compiler for one tokenizer: compiles each distinct constraint once, failures included (a bad
    per-row schema repeated on a million rows costs one failed compile, then a dictionary lookup per row)."""

    def __init__(self, tokenizer: PromptTokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 threads: int = 8):
        from transformers import PreTrainedTokenizerFast  # a dependency of xgrammar itself

        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer)
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=list(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.compiled: dict[Constraint, xgrammar.CompiledGrammar | GrammarError] = {}

    def compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        if constraint not in self.compiled:
            try:
                self.compiled[constraint] = self._compile(constraint)
            except RuntimeError as error:
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                self.compiled[constraint] = GrammarError(
                    f"{constraint.kind} cannot be compiled: {_CPP_PREFIX.sub('', first_line)}")
        result = self.compiled[constraint]
        if isinstance(result, GrammarError):
            raise result
        return result

    def _compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        # any_whitespace=False: JSON as json.dumps writes it (", " and ": ", no other whitespace). With free
        # whitespace small models (and random logits) can emit newlines until max_tokens, the failure vLLM's
        # `disable-any-whitespace` option exists for.
        if constraint.kind == "json_schema":
            return self.compiler.compile_json_schema(constraint.spec, any_whitespace=False)
        if constraint.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if constraint.kind == "regex":
            return self.compiler.compile_regex(constraint.spec)
        if constraint.kind == "choice":
            alternatives = "|".join(_regex_literal(option) for option in json.loads(constraint.spec))
            return self.compiler.compile_regex(f"({alternatives})")
        raise GrammarError(f"unknown constraint kind {constraint.kind!r}: choose one of {', '.join(KINDS)}")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


class GrammarBatch:
    """Grammar state for the engine's request slots (row r of the persistent per-request arrays), and the
    one bitmask every step's constrained rows are filled into.

    A step calls `fill_bitmask(rows)` with the slots of its sampling rows in logits order, `apply(logits,
    bitmask)` after taking raw logprobs (apply works in place), samples, then `advance(row, token)` for each
    constrained row. A step without a constrained row gets None from `fill_bitmask` and costs nothing more.

    The masks depend only on tokens sampled before the step, so they can be filled while its forward pass runs:
    xgrammar's batch fill runs on its own threads without the GIL (measured once: 50 fills of 256 rows, 0.10 s
    alone, beside 0.42 s of Python work took 0.40 s in all).
    """

    def __init__(self, grammars: Grammars, max_rows: int, threads: int = 8):
        self.grammars = grammars
        self.matchers: list[xgrammar.GrammarMatcher | None] = [None] * max_rows
        shape = xgrammar.get_bitmask_shape(max_rows, grammars.vocab_size)
        # pinned on a CUDA machine, so the copy to the device overlaps (the bitmask is filled on the CPU)
        self.bitmask = torch.full(shape, -1, dtype=xgrammar.bitmask_dtype, pin_memory=torch.cuda.is_available())
        self.filler = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def set(self, row: int, constraint: Constraint | None) -> None:
        """Give slot `row` a fresh matcher for `constraint` (None: unconstrained). Raises GrammarError."""
        self.matchers[row] = None if constraint is None else xgrammar.GrammarMatcher(
            self.grammars.compile(constraint))

    def clear(self, row: int) -> None:
        self.matchers[row] = None

    def fill_bitmask(self, rows: Sequence[int]) -> torch.Tensor | None:
        """The masks of `rows` (bitmask row i for rows[i]; an unconstrained row allows every token), or None
        when no row is constrained."""
        positions = [i for i, row in enumerate(rows) if self.matchers[row] is not None]
        if not positions:
            return None
        bitmask = self.bitmask[: len(rows)]
        if len(positions) < len(rows):
            bitmask[[i for i, row in enumerate(rows) if self.matchers[row] is None]] = -1
        self.filler.batch_fill_next_token_bitmask([self.matchers[rows[i]] for i in positions], bitmask, positions)
        return bitmask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor | None) -> None:
        """Masked tokens' logits become -inf, in place, in one op on the logits' device."""
        if bitmask is not None:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))

    def advance(self, row: int, token: int) -> bool:
        """Move slot `row` past `token`; False if the grammar rejects it (a token that was masked out)."""
        matcher = self.matchers[row]
        return True if matcher is None else matcher.accept_token(token)

    def is_finished(self, row: int) -> bool:
        """The grammar has ended: its EOS was accepted. After that only EOS was ever allowed."""
        matcher = self.matchers[row]
        return matcher is not None and matcher.is_terminated()
