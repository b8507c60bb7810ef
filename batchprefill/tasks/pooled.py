"""What task=embed and task=classify share: a prefill-only request per row whose readout takes final-norm hidden
states (or the sequence head on them) instead of logits, and the result columns both write beside their own.

A pooled request samples nothing (max_tokens 0), so its rows never get a logits row: no LM head runs for it, and a
base-model folder (no LM head at all) serves it. `last` reads one position, the prompt's last, which is always
computed (a cache hit leaves at least one token), so the prefix is taken from the cache like any prompt's. `mean`
reads every position: cached blocks hold KV, not hidden states, so a mean-pooled request takes no prefix from the
cache (`Request.reuse_prefix`) and computes its whole prompt; its cost is the prompt tokens with no reuse, which the
plan's `computed_tokens_without_reuse` gives. Per-block sums of hidden states kept beside the cached blocks would
lift that; they are not built.

The mean's sum is a running float64 cumulative sum in position order, so its value does not depend on how the
prompt was chunked or preempted: only on each position's state (what engine.batch_invariant makes stable).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.sampling_params import SamplingParams
from batchprefill.tasks.base import OrderedRows, PromptBatch

PREFILL_ONLY = SamplingParams(max_tokens=0)  # a pooled request samples nothing
ROW_FIELDS = [  # in place of the output_* columns
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
]


@dataclass(eq=False)
class PooledState:
    """A row's readout: the final-norm state at its last position (`states="hidden"`), the sequence head's outputs
    there (`states="head"`), or the mean of the states over every position (`mean`)."""

    states: str
    mean: bool = False
    normalize: bool = False  # scaled to unit L2 norm (model.normalize)
    value: np.ndarray | None = None  # the last position's row, or the running sum (float64) with `mean`
    rows: int = 0  # positions summed

    def select(self, request: Request, start: int, stop: int) -> tuple[list[int], list[int]]:
        return [], []  # no logits read

    def record(self, positions: list[int], logprobs: np.ndarray, greedy: np.ndarray) -> None:
        """Never called: it selects no logits."""

    def select_states(self, request: Request, start: int, stop: int) -> list[int]:
        if self.mean:
            return list(range(start, stop))
        return [stop - 1] if stop == request.num_tokens else []

    def record_states(self, positions: list[int], values: np.ndarray) -> None:
        if not self.mean:
            self.value = values[-1].copy()
            return
        if positions[0] == 0:  # the prompt starts again (a preempted request computes it once more)
            self.value, self.rows = np.zeros(values.shape[1]), 0
        self.value = np.cumsum(np.vstack([self.value, values.astype(np.float64)]), axis=0)[-1]
        self.rows += len(positions)

    def finish(self, request: Request) -> Request | None:
        request.finish_reason = "stop"  # INTERFACE.md's values: the row ended normally
        return request

    def row_prompt_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens

    def pooled(self) -> np.ndarray:
        """The row's vector, float64: the last state or the head's outputs, or the mean; with `normalize`, of unit
        L2 norm (a zero vector stays zero)."""
        vector = self.value / self.rows if self.mean else self.value.astype(np.float64)
        return vector / max(float(np.linalg.norm(vector)), 1e-12) if self.normalize else vector


def pooled_requests(rows: OrderedRows, states: str, mean: bool = False, normalize: bool = False) -> list[Request]:
    """A prefill-only request per row, each with its own PooledState."""
    return [Request(row, ids, PREFILL_ONLY, namespace, readout=PooledState(states, mean, normalize),
                    reuse_prefix=not mean)
            for row, ids, namespace in zip(rows.rows, rows.token_ids, rows.namespaces)]


def pooled_state(request: Request) -> PooledState | None:
    """The request's readout, None for a row that failed (it has no vector)."""
    readout = request.readout
    if not isinstance(readout, PooledState) or request.error is not None or readout.value is None:
        return None
    return readout


class PooledTask:
    """What task=embed and task=classify do alike: one prefill-only request per row, its prompt alone tokenized,
    the whole context open to it (nothing is sampled after), KV for its prompt only, one sample per row."""

    name = ""
    input_columns: tuple[tuple[str, str], ...] = ()
    internal_columns: tuple[str, ...] = ()

    def check(self, sampling: SamplingParams) -> None:
        if sampling.n != 1:
            raise JobError(f"task={self.name} reads each row once: set sampling.n=1, not {sampling.n}")

    def max_prompt_tokens(self, context: int, max_tokens: int) -> int:
        return context

    def tokenize(self, batch: PromptBatch) -> tuple[pa.ListArray, dict[str, pa.Array]]:
        return batch.prompt_tokens(batch.texts), {}

    def kv_tokens(self, prompt_tokens: int, output_tokens: int, samples: int) -> int:
        return prompt_tokens
