"""Decode-only steps on fixed, padded buffers: on CUDA each padded batch size is captured once as a CUDA
graph and replayed, so a decode step costs one launch instead of hundreds.

A graph replays fixed addresses and fixed launch grids, so every input lives in a persistent buffer,
the batch is padded up to the next captured size (padding rows write nowhere: slot -1) and the kernels
are planned for the longest context, reading each sequence's true length from the device (the decode
kernel splits each context into segments from that length).

Host work per step: vectorized writes into one persistent host buffer (pinned on CUDA), one non-blocking
copy of it to the device, one device-side copy of the block tables into their fixed-stride buffer, and the
replay, whose first kernels unpack the rest into the typed buffers the model reads.

Decodes that share full blocks (a system prompt) are grouped on the host from the block tables (`Ops.group_decodes`)
and staged with the rest, after the head: the attention reads each group's shared KV once for all its members,
over a fixed grid of group slots (an empty slot computes nothing), straight from the staged buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.shared_prefix import DecodeGroups
from batchprefill.model.decoder import DecoderModel

# Up to 1,024: engine.max_num_seqs=auto picks that on a large GPU (pipeline/engine_sizes.py).
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832,
               896, 960, 1024)
# The staged head, one row of `size` each: token ids, positions, slots, sequence lengths, and the row of the last
# step's sampled tokens (`previous`) each id is taken from instead (-1: its staged id), for the overlapped loop.
HEAD_ROWS = 5


def group_layout(size: int) -> tuple[int, int, int]:
    """(group slots, words per row part, int32 words) of a padded batch's decode groups, staged after the head:
    each row's shared length, the member rows, then (first member, count, shared tokens, table row) per group
    slot, each part 16 bytes aligned (a kernel specializes on its pointers' alignment: no size compiles another
    variant). Every group has 2 members or more (`Ops.group_decodes`), so size // 2 slots hold any step's."""
    slots, row_part = max(1, size // 2), -(-size // 4) * 4
    return slots, row_part, 2 * row_part + 4 * slots


def groups_start(size: int) -> int:
    """Where a padded batch's decode groups start in the staged buffer: after the head, 16 bytes aligned."""
    return -(-HEAD_ROWS * size // 4) * 4


class PaddedDecode:
    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_seqs: int, device: torch.device, capture: bool):
        if kv_caches[0][0].shape[0] * block_size >= 2**31:
            raise ValueError("the KV pool has more slots than int32 staging can address")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = [b for b in BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        largest = self.sizes[-1]
        self.max_len = model.config.max_positions
        self.width = -(-self.max_len // block_size)
        self.block_size = block_size
        self.heads_per_kv = model.config.num_heads // model.config.num_kv_heads
        int32 = dict(dtype=torch.int32, device=device)
        self.longs = torch.zeros(3, largest, dtype=torch.int64, device=device)  # ids, positions, slots
        self.seq_lens = torch.ones(largest, **int32)
        self.block_tables = torch.zeros(largest, self.width, **int32)
        self.query_start = torch.arange(largest + 1, **int32)
        self.rows = torch.arange(largest, dtype=torch.int64, device=device)
        self.previous = torch.zeros(largest, dtype=torch.int64, device=device)  # the last step's sampled tokens
        capacity = groups_start(largest) + group_layout(largest)[2] + largest * self.width
        self._pinned = device.type == "cuda"
        self._host = torch.empty(capacity, dtype=torch.int32, pin_memory=self._pinned)
        self._staged = torch.empty(capacity, **int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of `_host`
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all(device)

    def close(self) -> None:
        """Drop the graphs (their memory pool goes with them), the references to the KV pool and the buffers."""
        self.graphs.clear()
        self.kv_caches = []
        self.longs = self.seq_lens = self.block_tables = self.previous = self._staged = self._host = None

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start=self.query_start[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.longs[2, :size],
            query_lens_host=[1] * size, seq_lens_host=[self.max_len] * size, decode_groups=self._groups(size),
        )

    def _groups(self, size: int) -> DecodeGroups:
        """The staged decode groups of a padded batch: views of the staged buffer, at fixed addresses per size."""
        slots, part, words = group_layout(size)
        start = groups_start(size)
        region = self._staged[start : start + words]
        return DecodeGroups(groups=region[2 * part :].view(slots, 4), members=region[part : part + size],
                            shared_lens=region[:size])

    def _forward(self, size: int) -> torch.Tensor:
        """Unpack the staged head into the typed buffers, then the model: a graph captures both."""
        head = self._staged[: HEAD_ROWS * size].view(HEAD_ROWS, size)
        self.longs[:, :size].copy_(head[:3])
        self.seq_lens[:size].copy_(head[3])
        sources, ids = head[4], self.longs[0, :size]
        ids.copy_(torch.where(sources >= 0, self.previous[sources.clamp(min=0).long()], ids))
        return self.model(self.longs[0, :size], self.longs[1, :size], self.kv_caches, self._meta(size),
                          self.rows[:size])

    def _capture_all(self, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        nothing = np.zeros(0, dtype=np.int64)
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._stage(size, nothing, nothing, nothing, nothing, nothing, np.zeros((0, 0), dtype=np.int32))
            self._forward(size)  # compile and warm every kernel outside the capture, on padding rows only
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)

    def _stage(self, size: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
               seq_lens: np.ndarray, sources: np.ndarray, block_tables: np.ndarray) -> None:
        """Write one step into the host buffer (rows past the batch are padding) and copy it over at once."""
        batch, width = block_tables.shape
        if width > self.width:
            raise ValueError(f"a block table of {width} blocks is wider than max_positions allows ({self.width})")
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host.numpy()
        head = host[: HEAD_ROWS * size].reshape(HEAD_ROWS, size)
        for row, values, pad in zip(head, (input_ids, positions, slots, seq_lens, sources), (0, 0, -1, 1, -1),
                                    strict=True):
            row[:batch] = values
            row[batch:] = pad
        tables_start = groups_start(size) + self._stage_groups(host[groups_start(size) :], size, seq_lens,
                                                               block_tables)
        end = tables_start + batch * width
        host[tables_start:end].reshape(batch, width)[:] = block_tables
        self._staged[:end].copy_(self._host[:end], non_blocking=True)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.block_tables[:batch, :width].copy_(self._staged[tables_start:end].view(batch, width))

    def _stage_groups(self, region: np.ndarray, size: int, seq_lens: np.ndarray, block_tables: np.ndarray) -> int:
        """Write the step's decode groups at the start of `region` (`group_layout`; no group: all zero, so every
        slot is empty and every row walks its whole context); returns the words written."""
        _, part, words = group_layout(size)
        region[:words] = 0
        found = None
        if len(seq_lens):
            found = self.model.ops.group_decodes(seq_lens, block_tables, self.block_size, self.heads_per_kv)
        if found is not None:
            region[: len(seq_lens)] = found.shared_lens
            region[part : part + len(found.members)] = found.members
            region[2 * part : 2 * part + found.groups.size] = found.groups.ravel()
        return words

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            block_tables: np.ndarray, gather_rows: np.ndarray | None = None, gather_sources: np.ndarray | None = None,
            previous: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[batch, vocab]` for one decode token per sequence; `block_tables` is [batch, width]. Rows
        `gather_rows` take their token from `previous` (the last step's sampled tokens, on the device) at
        `gather_sources` instead of `input_ids` (the overlapped loop)."""
        batch = len(input_ids)
        size = next(s for s in self.sizes if s >= batch)
        sources = np.full(batch, -1, dtype=np.int64)
        if gather_rows is not None and len(gather_rows):
            sources[gather_rows] = gather_sources
            self.previous[: len(previous)].copy_(previous)
        self._stage(size, input_ids, positions, slots, seq_lens, sources, block_tables)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:batch]
        return self._forward(size)[:batch]
