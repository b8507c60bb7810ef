"""Decode-only steps on fixed, padded buffers: on CUDA each padded batch size is captured once as a CUDA
graph and replayed, so a decode step costs one launch instead of hundreds.

A graph replays fixed addresses and fixed launch grids, so every input lives in a persistent buffer,
the batch is padded up to the next captured size (padding rows write nowhere: slot -1) and the kernels
are planned for the longest context, reading each sequence's true length from the device.
"""

from __future__ import annotations

import torch

from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.model.decoder import DecoderModel

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class PaddedDecode:
    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_seqs: int, device: torch.device, capture: bool):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = [b for b in BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        largest = self.sizes[-1]
        max_len = model.config.max_positions
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, **int32)
        self.block_tables = torch.zeros(largest, cdiv(max_len, block_size), **int32)
        self.query_start = torch.arange(largest + 1, **int32)
        self.rows = torch.arange(largest, dtype=torch.int64, device=device)
        self.max_len = max_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all(device)

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start=self.query_start[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slots[:size],
            query_lens_host=[1] * size, seq_lens_host=[self.max_len] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size),
                          self.rows[:size])

    def _capture_all(self, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._forward(size)  # compile and warm every kernel outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Logits `[batch, vocab]` for one decode token per sequence."""
        batch = len(input_ids)
        size = next(s for s in self.sizes if s >= batch)
        width = max(len(t) for t in tables)
        padded_tables = torch.zeros(batch, width, dtype=torch.int32)
        for row, table in enumerate(tables):
            padded_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.input_ids[:batch].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.slots[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[batch:size].fill_(1)
        self.block_tables[:batch, :width].copy_(padded_tables, non_blocking=True)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:batch]
        return self._forward(size)[:batch]
