"""Turns a scheduled step into one flat forward pass over the paged KV pool."""

from __future__ import annotations

import numpy as np
import torch

from batchprefill.engine.decode_graphs import PaddedDecode
from batchprefill.engine.scheduler import Step
from batchprefill.kernels.ops import AttentionMetadata
from batchprefill.model.decoder import DecoderModel


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, padded_decode: str = "off", max_num_seqs: int = 256):
        """`padded_decode`: "off", "eager" (fixed padded buffers, no capture: for tests) or "graphs" (CUDA)."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.decoder = None
        if padded_decode != "off":
            self.decoder = PaddedDecode(model, self.kv_caches, block_size, max_num_seqs, device,
                                        capture=padded_decode == "graphs")

    def run(self, step: Step) -> tuple[torch.Tensor, list[int]]:
        """Logits for every chunk that reaches the end of its known tokens, and those chunks' indices."""
        size = self.block_size
        ids, positions, slots, query_lens, seq_lens, tables, sampled = [], [], [], [], [], [], []
        for index, chunk in enumerate(step.chunks):
            request, count = chunk.request, chunk.num_tokens
            start = request.num_computed_tokens
            span = np.arange(start, start + count)
            table = np.asarray(request.block_table, dtype=np.int64)
            ids.extend(request.tokens(start, start + count))
            positions.append(span)
            slots.append(table[span // size] * size + span % size)
            query_lens.append(count)
            seq_lens.append(start + count)
            tables.append(table)
            if start + count == request.num_tokens:
                sampled.append(index)
        if self.decoder and len(sampled) == len(ids) and self.decoder.fits(len(ids)):
            logits = self.decoder.run(ids, np.concatenate(positions).tolist(), np.concatenate(slots).tolist(),
                                      seq_lens, [t.tolist() for t in tables])
            return logits, sampled
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        query_start = np.concatenate([[0], np.cumsum(query_lens)])
        rows = query_start[1:][sampled] - 1
        to = lambda array, dtype: torch.from_numpy(np.asarray(array)).to(device=self.device, dtype=dtype)  # noqa: E731
        meta = AttentionMetadata(
            query_start=to(query_start, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            block_tables=to(block_tables, torch.int32),
            slot_mapping=to(np.concatenate(slots), torch.int64),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        logits = self.model(
            to(ids, torch.int64), to(np.concatenate(positions), torch.int64), self.kv_caches, meta,
            to(rows, torch.int64),
        )
        return logits, sampled
