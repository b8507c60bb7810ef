"""The grammar's part of an engine step, for jobs whose requests can be constrained (structured outputs).

An engine gets one only when some request may carry a constraint (SGLang's way): an unconstrained job runs
the same step as before, with no per-row work added. With one, each step

1. gives a matcher to every sampled request that has none in its batch row yet (a new or a preempted
   request: its outputs so far are replayed into the matcher),
2. starts filling the sampled rows' bitmask on a worker thread before the forward pass (the masks depend only
   on earlier tokens, and xgrammar fills on its own threads without the GIL),
3. after the forward (and after raw logprobs are read) collects the bitmask and masks the logits in one op,
4. after sampling, advances every constrained request's matcher by its token, in one batched call.

Constraints touch sampling only: the scheduler, the prefix cache and prefill never see them.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from batchprefill.constraint import GrammarError
from batchprefill.engine.grammar import GrammarBatch, Grammars
from batchprefill.engine.request import Request
from batchprefill.engine.scheduler_output import SchedulerOutput

FILL_THREADS = min(8, os.cpu_count() or 1)  # xgrammar's threads for one batch fill (grammar.py measured 2)


class StructuredOutputs:
    """An engine's structured outputs: a grammar matcher per constrained batch row, and each step's masks."""

    def __init__(self, grammars: Grammars, max_rows: int, threads: int = FILL_THREADS):
        self.grammars = grammars
        self.batch = GrammarBatch(grammars, max_rows, threads)
        self.owners: list[Request | None] = [None] * max_rows  # whose matcher each batch row holds
        self.filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")

    def compile_error(self, request: Request) -> str | None:
        """Why the request's constraint cannot be used, or None (compiled once per distinct constraint)."""
        try:
            self.grammars.compile(request.sampling.constraint)
        except GrammarError as error:
            return str(error)
        return None

    def start(self, step: SchedulerOutput, sampled: np.ndarray) -> Future[torch.Tensor | None]:
        """Begin filling the masks of the step's sampled chunks (`sampled`: their indices, in logits order)."""
        rows = []
        for index in sampled.tolist():
            request = step.requests[index]
            row = request.batch_row
            if self.owners[row] is not request:
                self._admit(row, request)
            rows.append(row)
        return self.filler.submit(self.batch.fill_bitmask, rows)

    def mask(self, logits: torch.Tensor, masks: Future[torch.Tensor | None]) -> None:
        """Disallowed tokens' logits become -inf, in place: after raw logprobs, before sampling."""
        GrammarBatch.apply(logits, masks.result())

    def advance(self, requests: list[Request], tokens: list[int]) -> list[str | None]:
        """Move every sampled request's matcher past its new token, in one batched call: for each, the finish
        reason if the grammar ends the request (`stop` when it is complete, `error` if it rejects the token),
        else None."""
        rows = [request.batch_row for request in requests]
        accepted = self.batch.advance_rows(rows, tokens)
        return [("stop" if self.batch.is_finished(row) else None) if ok else "error"
                for row, ok in zip(rows, accepted)]

    def release(self, request: Request) -> None:
        """A finished or preempted request's matcher goes; a preempted one gets a new one when it runs again."""
        row = request.batch_row
        if row >= 0 and self.owners[row] is request:
            self.batch.clear(row)
            self.owners[row] = None

    def _admit(self, row: int, request: Request) -> None:
        self.batch.set(row, request.sampling.constraint)
        for token in request.output_token_ids:
            self.batch.advance(row, token)
        self.owners[row] = request
