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

from batchprefill.engine.request import PENDING_TOKEN, Request
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
    # [R] bool: the sampled rows that may end whatever token they sample (max_tokens reached, or stop strings to look
    # for); the others end only on an EOS token or at the engine's position limit. Its bookkeeping visits only those.
    may_end: np.ndarray
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
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # blocks of each row's table copied in
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.keys = np.zeros(max_num_seqs, dtype=np.uint64)
        self.num_outputs = np.zeros(max_num_seqs, dtype=np.int64)
        self.samples = np.ones(max_num_seqs, dtype=bool)  # max_tokens > 0: it samples after its prompt
        self.max_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.stops = np.zeros(max_num_seqs, dtype=bool)  # it has stop strings
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
        self.max_tokens[row] = params.max_tokens
        self.stops[row] = bool(params.stop)
        self.keys[row] = request_key(params.seed, request.request_id, request.sample_index)
        self.num_outputs[row] = len(request.output_token_ids)
        self.adapter[row] = request.adapter
        self.num_blocks[row] = 0
        return row

    def prepare(self, step: SchedulerOutput) -> ForwardInputs:
        """The step's flat batch from the step's columns. Only the chunks that need it are visited in Python: new
        rows, block tables that grew, the prompt chunks' token ids; a decode's input id is its last output (or,
        when that is still on the device, PENDING_TOKEN, which the device gathers). At 1,024 decodes a step
        (benchmarks/cpu/host_overhead.py --seqs 1024 --stub-forward) one Python pass over every chunk took 0.54 ms."""
        requests = step.requests
        num_chunks, num_decodes = len(requests), step.num_decode_tokens
        rows_a = np.fromiter(map(_batch_row, requests), np.int64, num_chunks)
        for index in np.flatnonzero(rows_a < 0).tolist():
            rows_a[index] = self._admit(requests[index])
        num_blocks, table = step.num_blocks, self.block_table
        for index in np.flatnonzero(num_blocks != self.num_blocks[rows_a]).tolist():
            row, blocks = rows_a[index], requests[index].block_table
            have = self.num_blocks[row]
            table[row, have : len(blocks)] = blocks[have:]
        self.num_blocks[rows_a] = num_blocks
        width = int(num_blocks.max())
        starts_a, counts_a = step.starts, step.num_tokens
        totals = starts_a + 1  # a decode's tokens: the computed ones and the one sampled last step
        last = np.fromiter(map(_last_output, requests[:num_decodes]), np.int64, num_decodes)
        pending = np.flatnonzero(last == PENDING_TOKEN)
        gathers = {}
        if pending.size:  # still on the device (the overlapped loop)
            gathers = {"gather_rows": pending, "gather_sources": np.fromiter(
                (requests[i].pending_sample for i in pending.tolist()), np.int64, pending.size)}
            last[pending] = 0
        prompt_ids: list[int] = []
        prompt_totals: list[int] = []
        for request, start, count in zip(requests[num_decodes:], starts_a[num_decodes:].tolist(),
                                         counts_a[num_decodes:].tolist()):
            prompt_ids.extend(request.tokens(start, start + count))
            prompt_totals.append(request.num_tokens)
        totals[num_decodes:] = prompt_totals
        query_start = np.zeros(num_chunks + 1, dtype=np.int64)
        np.cumsum(counts_a, out=query_start[1:])
        token_rows = np.repeat(rows_a, counts_a)
        positions = np.arange(query_start[-1], dtype=np.int64) - np.repeat(query_start[:-1] - starts_a, counts_a)
        size = self.block_size
        slots = table[token_rows, positions // size].astype(np.int64) * size + positions % size
        seq_lens = starts_a + counts_a
        complete = seq_lens == totals
        samples = self.samples[rows_a]
        sampled = np.flatnonzero(complete & samples)
        sampled_rows = rows_a[sampled]
        sampling = SamplingBatch(self.temperature[sampled_rows], self.top_k[sampled_rows], self.top_p[sampled_rows],
                                 self.keys[sampled_rows], self.num_outputs[sampled_rows])
        self.num_outputs[sampled_rows] += 1
        may_end = self.stops[sampled_rows] | (self.num_outputs[sampled_rows] >= self.max_tokens[sampled_rows])
        return ForwardInputs(
            input_ids=np.concatenate((last, np.array(prompt_ids, dtype=np.int64))), positions=positions,
            slot_mapping=slots,
            query_start=query_start.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
            block_tables=table[rows_a, :width], logits_rows=query_start[1:][sampled] - 1,
            sampled=sampled, sampling=sampling, prefilled=np.flatnonzero(complete & ~samples),
            token_adapters=self.adapter[token_rows], may_end=may_end, **gathers,
        )


def _batch_row(request: Request) -> int:
    return request.batch_row


def _last_output(request: Request) -> int:
    return request.output_token_ids[-1]
