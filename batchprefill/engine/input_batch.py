"""Per-request state that persists across steps, one row per running request (vLLM v1's persistent batch).

A step changes only a few rows: a newly admitted request gets a row and its sampling settings, a decode
appends a block every `block_size` tokens, a finished or preempted request gives its row back. So a step's
metadata (positions, cache slots, block tables, sampling vectors) is gathered from these arrays with a
handful of vectorized numpy operations instead of being rebuilt from Python lists, one request at a time.
Measured on benchmarks/cpu/host_overhead.py (256 decodes per step): see BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchprefill.engine.request import Request
from batchprefill.engine.sampler import SamplingBatch, request_key
from batchprefill.engine.scheduler_output import SchedulerOutput
from batchprefill.intmath import cdiv


@dataclass
class ForwardInputs:
    """One step's flat batch on the host, ready to go to the device."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start: np.ndarray  # [S+1] int32
    seq_lens: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, width] int32
    logits_rows: np.ndarray  # [R] int64: the flat-batch row of each sequence that samples this step
    sampled: np.ndarray  # [R] int64: which chunks of the step those are
    sampling: SamplingBatch  # their sampling settings, one entry per logits row
    # Chunks that complete their prompt this step and sample nothing (max_tokens 0: a readout's request): they get
    # no logits row, so a prefill-only step never runs the LM head.
    prefilled: np.ndarray
    token_adapters: np.ndarray  # [T] int32: each token's LoRA adapter index (0: the base model)
    # The overlapped loop's decodes whose input token is still on the device: their rows of `input_ids` (which hold
    # 0 there) take the previous step's sampled token at `gather_sources`, gathered on the device.
    gather_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    gather_sources: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens) == len(self.sampled)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int):
        self.block_size = block_size
        self.block_table = np.zeros((max_num_seqs, cdiv(max_model_len, block_size) + 1), dtype=np.int32)
        self.num_blocks = [0] * max_num_seqs  # blocks of each row's table copied in (a list: read per chunk)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.keys = np.zeros(max_num_seqs, dtype=np.uint64)
        self.num_outputs = np.zeros(max_num_seqs, dtype=np.int64)
        self.samples = np.ones(max_num_seqs, dtype=bool)  # max_tokens > 0: it samples after its prompt
        self.adapter = np.zeros(max_num_seqs, dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))

    def release(self, request: Request) -> None:
        """A finished or preempted request gives its row back."""
        if request.batch_row >= 0:
            self.free_rows.append(request.batch_row)
            request.batch_row = -1

    def _admit(self, request: Request) -> int:
        row = request.batch_row = self.free_rows.pop()
        params = request.sampling
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.samples[row] = params.max_tokens > 0
        self.keys[row] = request_key(params.seed, request.request_id, request.sample_index)
        self.num_outputs[row] = len(request.output_token_ids)
        self.adapter[row] = request.adapter
        self.num_blocks[row] = 0
        return row

    def _sync_blocks(self, request: Request, row: int) -> None:
        """Copy in the blocks the scheduler appended since the last step."""
        have = self.num_blocks[row]
        table = request.block_table
        self.block_table[row, have : len(table)] = table[have:]
        self.num_blocks[row] = len(table)

    def prepare(self, step: SchedulerOutput) -> ForwardInputs:
        """The step's flat batch: one pass over its chunks in Python, the rest vectorized. The pass reads each
        request's lists once (no property calls) and notes its token count for the sampled-row test; on
        benchmarks/cpu/host_overhead.py (255 sequences per step, one thread, a loaded machine) prepare went from
        0.64 to 0.46-0.51 ms."""
        rows, starts, counts, totals, ids, gathers = [], [], [], [], [], []
        num_blocks = self.num_blocks
        width = 0
        for chunk in step.chunks:
            request = chunk.request
            row = request.batch_row
            if row < 0:
                row = self._admit(request)
            blocks = len(request.block_table)
            if blocks != num_blocks[row]:
                self._sync_blocks(request, row)
            if blocks > width:
                width = blocks
            start, count = request.num_computed_tokens, chunk.num_tokens
            outputs = request.output_token_ids
            total = len(request.prompt_token_ids) + len(outputs)
            if count == 1 and outputs and start == total - 1:  # a decode: the token sampled last step
                if request.pending_sample >= 0:  # still on the device (the overlapped loop)
                    gathers.append((len(ids), request.pending_sample))
                    ids.append(0)
                else:
                    ids.append(outputs[-1])
            else:
                ids.extend(request.tokens(start, start + count))
            rows.append(row)
            starts.append(start)
            counts.append(count)
            totals.append(total)
        rows_a = np.array(rows, dtype=np.int64)
        starts_a = np.array(starts, dtype=np.int64)
        counts_a = np.array(counts, dtype=np.int64)
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts_a, out=query_start[1:])
        token_rows = np.repeat(rows_a, counts_a)
        positions = np.arange(query_start[-1], dtype=np.int64) - np.repeat(query_start[:-1] - starts_a, counts_a)
        size = self.block_size
        slots = self.block_table[token_rows, positions // size].astype(np.int64) * size + positions % size
        seq_lens = starts_a + counts_a
        complete = seq_lens == np.array(totals, dtype=np.int64)
        samples = self.samples[rows_a]
        sampled = np.flatnonzero(complete & samples)
        sampled_rows = rows_a[sampled]
        sampling = SamplingBatch(self.temperature[sampled_rows], self.top_k[sampled_rows], self.top_p[sampled_rows],
                                 self.keys[sampled_rows], self.num_outputs[sampled_rows])
        self.num_outputs[sampled_rows] += 1
        return ForwardInputs(
            input_ids=np.array(ids, dtype=np.int64), positions=positions, slot_mapping=slots,
            query_start=query_start.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
            block_tables=self.block_table[rows_a, :width], logits_rows=query_start[1:][sampled] - 1,
            sampled=sampled, sampling=sampling, prefilled=np.flatnonzero(complete & ~samples),
            token_adapters=self.adapter[token_rows],
            **_gathers(gathers),
        )


def _gathers(gathers: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    if not gathers:
        return {}
    rows, sources = np.array(gathers, dtype=np.int64).T
    return {"gather_rows": rows, "gather_sources": sources}
