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

import torch
import xgrammar

from batchprefill.constraint import KINDS, Constraint, GrammarError
from batchprefill.model.tokenizer import PromptTokenizer

# xgrammar prefixes its errors with a timestamp and its C++ source line: "[19:54:38] /project/cpp/x.cc:94: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/-")


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

    def advance_rows(self, rows: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """Move every slot of `rows` past its token in one batched call (xgrammar's batch accept: one trip into
        its C++ for the step, 1.8 to 4.4x cheaper than a call per row, benchmarks/cpu/grammar.py); False where the
        grammar rejects the token. Unconstrained slots accept anything."""
        positions = [i for i, row in enumerate(rows) if self.matchers[row] is not None]
        accepted = [True] * len(rows)
        if positions:
            verdicts = xgrammar.BatchGrammarMatcher.batch_accept_token([self.matchers[rows[i]] for i in positions],
                                                                       [tokens[i] for i in positions])
            for i, verdict in zip(positions, verdicts):
                accepted[i] = bool(verdict)
        return accepted

    def is_finished(self, row: int) -> bool:
        """The grammar has ended: its EOS was accepted. After that only EOS was ever allowed."""
        matcher = self.matchers[row]
        return matcher is not None and matcher.is_terminated()
