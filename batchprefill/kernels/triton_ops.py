"""`TritonOps`: the `Ops` interface on Triton kernels, same layouts and results as `TorchOps`."""

from __future__ import annotations

import torch
import triton

from batchprefill.kernels import triton_elementwise
from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.triton_attention import (
    MAX_SEGMENTS,
    decode_attention,
    interpreting,
    prefill_attention,
)
from batchprefill.kernels.triton_moe import fused_experts


class TritonOps:
    """Triton kernels behind the `Ops` interface.

    Launch choices are made on the host from `meta.query_lens_host` / `meta.seq_lens_host`, so no call
    waits on the device. Tile sizes may be fixed for tests; by default they follow the batch shape.
    """

    graph_safe_decode = True  # decode grids depend only on the batch size and the planned longest context

    def __init__(self, block_m: int | None = None, block_n: int | None = None,
                 decode_min_segment: int = 256, decode_target_programs: int | None = None) -> None:
        self.block_m = block_m
        self.block_n = block_n
        self.decode_min_segment = decode_min_segment
        self.decode_target_programs = decode_target_programs
        self._tile_key: tuple | None = None  # the tile map is shared by every layer of a step
        self._tile_map: torch.Tensor | None = None

    @property
    def _block_n(self) -> int:
        """KV tokens per tile; any size works, as each row finds its own block."""
        return self.block_n or 64

    def plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int, dtype: torch.dtype
             ) -> AttentionMetadata:
        """Launch choices follow the host lengths the metadata already carries: nothing to build per step."""
        return meta

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        triton_elementwise.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_elementwise.rms_norm(x, weight, eps, residual)

    def rope(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_elementwise.rope(query, key, positions, cos_sin)

    def moe(self, hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
            ) -> torch.Tensor:
        return fused_experts(hidden, experts, topk_weights, topk_ids)

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_seqs == 0 or query.shape[0] == 0:
            return out
        if meta.is_decode_only:
            segment_len, num_segments = self.decode_split(meta, k_cache.shape[2])
            decode_attention(
                query, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_tables, scale,
                segment_len, num_segments, self._block_n, num_warps=4, num_stages=2, window=window,
            )
            return out
        block_m, block_n, num_warps, num_stages = self._prefill_config(meta, query.shape[2])
        prefill_attention(
            query, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_tables,
            self._tiles(meta, block_m, query.device), scale, block_m, block_n, num_warps, num_stages, window,
        )
        return out

    def _prefill_config(self, meta: AttentionMetadata, head_dim: int) -> tuple[int, int, int, int]:
        """(BLOCK_M, BLOCK_N, warps, stages): 128-row tiles only for long chunks without decodes, whose
        single query would waste most of the tile."""
        long_chunks = min(meta.query_lens_host) >= 128 and max(meta.query_lens_host) >= 512
        block_m = self.block_m or (128 if long_chunks and not interpreting() else 64)
        num_warps = 8 if block_m * head_dim >= 128 * 128 else 4
        return block_m, self._block_n, num_warps, 3 if head_dim <= 128 else 2

    def _tiles(self, meta: AttentionMetadata, block_m: int, device: torch.device) -> torch.Tensor:
        """[2, tiles] int32: (sequence, tile index in it) per query tile, longest KV first so the
        slowest programs start first."""
        key = (tuple(meta.query_lens_host), tuple(meta.seq_lens_host), block_m, device)
        if key != self._tile_key:
            tiles = []
            for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
                context = seq_len - q_len
                for t in range(triton.cdiv(q_len, block_m)):
                    tiles.append((context + min((t + 1) * block_m, q_len), s, t))
            tiles.sort(key=lambda tile: -tile[0])
            host = torch.tensor([[s for _, s, _ in tiles], [t for _, _, t in tiles]], dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory()
            self._tile_map = host.to(device, non_blocking=True)
            self._tile_key = key
        return self._tile_map

    def decode_split(self, meta: AttentionMetadata, num_kv_heads: int) -> tuple[int, int]:
        """(segment length, segment count) of a decode launch: contexts are split only until the grid fills
        the device, into segments of at least `decode_min_segment` tokens."""
        max_len = max(meta.seq_lens_host)
        target = self.decode_target_programs or _default_target_programs(meta.seq_lens.device)
        wanted = triton.cdiv(target, meta.num_seqs * num_kv_heads)
        most = min(MAX_SEGMENTS, triton.cdiv(max_len, self.decode_min_segment))
        num_segments = max(1, min(wanted, most))
        segment_len = triton.cdiv(triton.cdiv(max_len, num_segments), self._block_n) * self._block_n
        return segment_len, triton.cdiv(max_len, segment_len)


def _default_target_programs(device: torch.device) -> int:
    """Two waves of programs per SM keep every SM busy; off the GPU, a small fixed figure."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16
