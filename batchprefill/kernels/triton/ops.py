"""`TritonOps`: the `Ops` interface on Triton kernels, same layouts and results as `TorchOps`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton

from batchprefill.kernels import shared_prefix
from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.lora import LoraStep, LoraWeights
from batchprefill.kernels.shared_prefix import DecodeGroups
from batchprefill.kernels.triton import elementwise as triton_elementwise
from batchprefill.kernels.triton.attention import (
    MAX_PREFIX_SEGMENTS,
    MAX_SEGMENTS,
    decode_attention,
    dot_settings,
    interpreting,
    prefill_attention,
)
from batchprefill.kernels.triton.lora import segmented_lora
from batchprefill.kernels.triton.moe import fused_experts
from batchprefill.kernels.triton.shared_decode import SHARED_ROWS, group_shape, shared_decode_attention

ALIGN = 4  # int32 entries: the decode rows start 16 bytes aligned inside the step's plan tensor
# Query rows per prefill tile in a batch-invariant step, whatever the chunks: the tile the default picks for all
# but long chunks (a decode then fills one row of it; see `TritonOps`).
INVARIANT_BLOCK_M = 64
# Shared memory one program may have on GPUs of Ada's and consumer Ampere's class (L4, L40S, A10, RTX 4090): 99 KB,
# against 163 KB on an A100 and 227 KB on Hopper. There, prefill and shared-prefix tiles of 4-byte operands or of
# heads wider than 128 need 104-144 KB, and the GPU refuses the launch (benchmarks/gpu/kernel_variants.py compiled
# every variant for sm_89), so on such a GPU those tiles narrow (`_narrow`).
SMALL_SHARED_MEMORY = 128 * 1024
# The prefill launch of long chunks on Hopper (sm90), by (head_dim padded to a power of 2, the chunks come after a
# cached context): (block_m, block_n, num_warps, num_stages), the best of 36 candidates each as
# benchmarks/gpu/gpu_prefill_tiles.py timed them on the H200 (torch 2.11, Triton 3.6).
HOPPER_PREFILL_TILES: dict[tuple[int, bool], tuple[int, int, int, int]] = {
    (64, False): (128, 64, 8, 2),  # 0.71x flash SDPA (geometric mean, 1k-8k tokens); before (128, 64, 4, 3): 0.63x
    (64, True): (128, 128, 4, 4),  # 0.99x (512-2048 after 4k-32k cached); before: 0.87x
    (128, False): (128, 128, 8, 2),  # 0.56x; before (128, 64, 8, 3): 0.51x
    (128, True): (128, 128, 8, 4),  # 1.14x; before: 0.96x
}


@dataclass
class TritonPlan:
    """What every layer of one step launches: prefill tiles for the chunks, decode rows for single tokens."""

    tile_map: torch.Tensor | None  # [tiles, 2] int32 (sequence, tile index in it), longest KV first
    decode_rows: torch.Tensor | None  # [decodes] int32 sequence indices; None when every row is a decode
    num_decodes: int
    block_m: int
    num_segments: int  # decode grid depth
    prefill_launch: tuple[int, int, int] | None = None  # (block_n, num_warps, num_stages) from the Hopper table
    # The decodes grouped by shared prefix (`shared_prefix.DecodeGroups` on the device, planned from the host
    # tables or the padded decode's fixed slots; None: no two decodes share a block, and they launch as before),
    # and the depth of the group programs' grid.
    decode_groups: DecodeGroups | None = None
    prefix_segments: int = 1


class TritonOps:
    """Triton kernels behind the `Ops` interface.

    Launch choices are made on the host from `meta.query_lens_host` / `meta.seq_lens_host`, so no call
    waits on the device. Tile sizes may be fixed for tests; by default they follow the batch shape. In a
    mixed step, chunks run through the prefill kernel and single-token rows through the decode kernel
    (in a 64-row prefill tile a decode would use 1/64 of the tile and read each KV head once per query head).
    Chunks with nothing cached before them stay on the prefill kernel too: torch's flash attention on the step's
    own keys (no gather) ran at 0.42-0.61x of flash SDPA on the H200 where the kernel's measured tiles reach
    0.56-0.76x (benchmarks/gpu/gpu_prefill_tiles.py, its `routed` rows).

    With `batch_invariant`, a row's bits must not depend on what shares its step, so nothing is chosen from the
    step: prefill tiles are always `INVARIANT_BLOCK_M` rows, every KV tile is masked (`MASK_ALL`), and decodes go
    through the prefill kernel as 1-row tiles, never split into segments. A position then comes out the same as
    a decode, in any chunk, or after a preemption recomputes it as a prefill. It costs decodes the GQA sharing
    (each query head reads its KV head on its own) and 63 idle rows per tile; the MoE and LoRA kernels keep
    fixed tiles too; no chunk goes to flash attention, whose tiling follows its shapes.

    Decodes that share full blocks (a system prompt) are grouped on the host from `meta.block_tables_host`, or
    come grouped in `meta.decode_groups` (the padded decode's fixed buffers): each group's shared KV is read
    once for all its members (shared_decode.py), each decode's own blocks as before. Not under a sliding window
    (such a layer launches the plain decode), and not with `batch_invariant`.
    """

    graph_safe_decode = True  # decode grids depend only on the batch size and the planned longest context

    def __init__(self, block_m: int | None = None, block_n: int | None = None,
                 decode_min_segment: int = 256, decode_target_programs: int | None = None,
                 batch_invariant: bool = False, shared_rows: int = SHARED_ROWS) -> None:
        self.batch_invariant = batch_invariant
        self.shared_rows = shared_rows  # query-matrix rows of a shared-prefix group program
        self.block_m = block_m or (INVARIANT_BLOCK_M if batch_invariant else None)
        self.block_n = block_n
        self.decode_min_segment = decode_min_segment
        self.decode_target_programs = decode_target_programs
        self._host: torch.Tensor | None = None  # persistent (pinned on CUDA) staging for the plan's one copy
        self._device: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last copy out of `_host`
        self._single_tiles: torch.Tensor | None = None  # [n, 2] rows (i, 0): an invariant decode step's tiles

    def _block_n(self, dtype: torch.dtype, narrow: bool) -> int:
        """KV tokens per tile; any size works, as each row finds its own block. Exact fp32 dots get half
        width, as their operands take twice the registers of TF32 ones, and so do `narrow` tiles."""
        if self.block_n:
            return self.block_n
        return 32 if narrow or (dot_settings(dtype)[1] == "ieee" and not interpreting()) else 64

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        triton_elementwise.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_elementwise.rms_norm(x, weight, eps, residual)

    def rope(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_elementwise.rope(query, key, positions, cos_sin)

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return triton_elementwise.gated_activation(gate_up, activation)

    def moe(self, hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
            ) -> torch.Tensor:
        return fused_experts(hidden, experts, topk_weights, topk_ids, self.batch_invariant)

    def lora(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, step: LoraStep) -> None:
        segmented_lora(out, x, weights, step, self.batch_invariant)

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_seqs == 0 or query.shape[0] == 0:
            return out
        if meta.plan is None:  # a caller outside the model (a test, a benchmark) planned nothing
            meta = self.plan(meta, k_cache, query.shape[1], query.dtype)
        plan = meta.plan
        narrow = _narrow(query.dtype, query.shape[2], k_cache.device)
        block_n = self._block_n(query.dtype, narrow)
        tile_map = plan.tile_map
        if tile_map is not None:
            prefill_n, num_warps, num_stages = plan.prefill_launch or (
                block_n, *prefill_warps_and_stages(plan.block_m, query.shape[2], narrow))
            prefill_attention(
                query, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_tables, tile_map,
                scale, plan.block_m, prefill_n, num_warps, num_stages, window, self.batch_invariant,
            )
        if plan.num_decodes and plan.decode_groups is not None and window is None:
            groups = plan.decode_groups
            shared_decode_attention(
                query, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_tables, plan.decode_rows,
                groups.groups, groups.members, groups.shared_lens, scale, plan.prefix_segments, plan.num_segments,
                self.decode_min_segment, block_n, self.shared_rows,
            )
        elif plan.num_decodes:
            decode_attention(
                query, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_tables, plan.decode_rows,
                scale, plan.num_segments, self.decode_min_segment, block_n, num_warps=4, num_stages=2,
                window=window,
            )
        return out

    def group_decodes(self, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int, heads_per_kv: int
                      ) -> DecodeGroups | None:
        """A decode-only step's groups (`Ops.group_decodes`), as the shared-prefix decode reads them."""
        if self.batch_invariant:
            return None
        members, _ = group_shape(heads_per_kv, self.shared_rows)
        return shared_prefix.group_decodes(seq_lens, block_tables, np.arange(len(seq_lens)), block_size, members)

    def plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int, dtype: torch.dtype
             ) -> AttentionMetadata:
        """`meta` with the step's launches attached, built before the first layer with one host-to-device copy.

        A decode-only step copies nothing unless its decodes form groups, so a CUDA graph can capture it (the
        padded decode brings its groups in its own buffers)."""
        num_kv_heads, device = k_cache.shape[2], k_cache.device
        query_lens = np.asarray(meta.query_lens_host)
        seq_lens = np.asarray(meta.seq_lens_host)
        if self.batch_invariant:
            return meta.with_plan(self._invariant_plan(query_lens, seq_lens, device))
        chunks = np.flatnonzero(query_lens > 1)
        decodes = np.flatnonzero(query_lens == 1)
        block_m, launch = self._choose_tiles(query_lens[chunks], seq_lens[chunks], k_cache, dtype)
        num_segments = self._decode_segments(seq_lens[decodes], num_kv_heads, device) if len(decodes) else 1
        host_groups = None
        if len(decodes) and meta.decode_groups is None and meta.block_tables_host is not None:
            members, _ = group_shape(num_q_heads // num_kv_heads, self.shared_rows)
            host_groups = shared_prefix.group_decodes(seq_lens[decodes], meta.block_tables_host[decodes], decodes,
                                                      k_cache.shape[1], members)
        tile_map = decode_rows = None
        decode_groups = meta.decode_groups if len(decodes) == len(query_lens) else None
        parts: dict[str, np.ndarray] = {}
        if len(chunks):
            parts["tiles"] = _tile_map(query_lens[chunks], seq_lens[chunks], chunks, block_m).ravel()
            parts["decodes"] = decodes
        if host_groups is not None:
            parts |= {"groups": host_groups.groups.ravel(), "members": host_groups.members,
                      "shared_lens": host_groups.shared_lens}
        if parts:
            staged = self._stage_parts(parts, device)
            tile_map = staged["tiles"].view(-1, 2) if len(chunks) else None
            decode_rows = staged["decodes"] if len(chunks) and len(decodes) else None
            if host_groups is not None:
                decode_groups = DecodeGroups(staged["groups"].view(-1, 4), staged["members"], staged["shared_lens"])
        prefix_segments = 1
        if host_groups is not None:
            prefix_segments = self._prefix_segments(int(host_groups.groups[:, 2].max()), len(host_groups.groups),
                                                    num_kv_heads, device)
        elif decode_groups is not None:  # fixed slots, mostly empty: as many groups as full sub-groups make
            members, _ = group_shape(num_q_heads // num_kv_heads, self.shared_rows)
            expected = min(decode_groups.groups.shape[0], triton.cdiv(len(decodes), members))
            prefix_segments = self._prefix_segments(int(seq_lens.max()), expected, num_kv_heads, device)
        return meta.with_plan(TritonPlan(tile_map, decode_rows, len(decodes), block_m, num_segments, launch,
                                         decode_groups, prefix_segments))

    def _stage_parts(self, parts: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
        """`_stage` of named parts, each starting 16 bytes aligned (so no alignment depends on another's size)."""
        offsets, size = [], 0
        for part in parts.values():
            offsets.append(size)
            size += triton.cdiv(len(part), ALIGN) * ALIGN
        staged = self._stage(list(parts.values()), offsets, size, device)
        return {name: staged[offset : offset + len(part)]
                for (name, part), offset in zip(parts.items(), offsets, strict=True)}

    def _invariant_plan(self, query_lens: np.ndarray, seq_lens: np.ndarray, device: torch.device) -> TritonPlan:
        """Every sequence tiled for the prefill kernel, decodes included. A decode-only step's tiles, one per
        sequence, are a slice of a persistent device tensor: no copy, so a CUDA graph still captures it."""
        if (query_lens == 1).all():
            tile_map = self._one_tile_each(len(query_lens), device)
        else:
            seqs = np.flatnonzero(query_lens > 0)
            tiles = _tile_map(query_lens[seqs], seq_lens[seqs], seqs, self.block_m)
            tile_map = self._stage([tiles.ravel()], [0], tiles.size, device).view(-1, 2)
        return TritonPlan(tile_map, None, 0, self.block_m, 1)

    def _one_tile_each(self, count: int, device: torch.device) -> torch.Tensor:
        """Rows (i, 0) for i < count, grown only outside a capture (the padded decode warms its largest size
        first)."""
        if self._single_tiles is None or self._single_tiles.shape[0] < count:
            capacity = triton.next_power_of_2(count)
            tiles = torch.zeros(capacity, 2, dtype=torch.int32, device=device)
            tiles[:, 0] = torch.arange(capacity, dtype=torch.int32, device=device)
            self._single_tiles = tiles
        return self._single_tiles[:count]

    def _stage(self, parts: list[np.ndarray], offsets: list[int], size: int, device: torch.device) -> torch.Tensor:
        """Copy int32 `parts` to the device at `offsets` of one persistent buffer, in one non-blocking copy.

        The buffers only grow; a refill of the host side first waits for the copy that last read it."""
        if self._host is None or self._host.numel() < size:
            capacity = triton.next_power_of_2(size)
            self._host = torch.empty(capacity, dtype=torch.int32, pin_memory=device.type == "cuda")
            self._device = torch.empty(capacity, dtype=torch.int32, device=device)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host.numpy()
        for part, offset in zip(parts, offsets, strict=True):
            host[offset : offset + len(part)] = part
        self._device[:size].copy_(self._host[:size], non_blocking=True)
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._device[:size]

    def _choose_tiles(self, chunk_lens: np.ndarray, seq_lens: np.ndarray, k_cache: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[int, tuple[int, int, int] | None]:
        """(block_m, the Hopper table's (block_n, num_warps, num_stages) or None for the default choice).

        Long 16-bit chunks on Hopper take the measured table (`HOPPER_PREFILL_TILES`) unless a test fixed a tile.
        Otherwise 128-row tiles only when every chunk is long (at least 128 queries, the longest 512 or more), as a
        short chunk would waste most of the tile. The interpreter takes 64 unless a test sets `block_m`."""
        if self.block_m:
            return self.block_m, None
        long_chunks = len(chunk_lens) > 0 and chunk_lens.min() >= 128 and chunk_lens.max() >= 512
        if interpreting():
            return 64, None
        if long_chunks and not self.block_n and dtype in (torch.float16, torch.bfloat16) and _hopper(k_cache.device):
            after_cached = bool((seq_lens > chunk_lens).any())
            tiles = HOPPER_PREFILL_TILES.get((triton.next_power_of_2(k_cache.shape[3]), after_cached))
            if tiles is not None:
                return tiles[0], tiles[1:]
        return (128 if long_chunks and not _narrow(dtype, k_cache.shape[3], k_cache.device) else 64), None

    def decode_segments(self, meta: AttentionMetadata, num_kv_heads: int) -> int:
        """Grid depth of a decode-only launch of `meta` (the benchmark reports it)."""
        return self._decode_segments(np.asarray(meta.seq_lens_host), num_kv_heads, meta.seq_lens.device)

    def _prefix_segments(self, longest_shared: int, num_group_slots: int, num_kv_heads: int, device: torch.device
                         ) -> int:
        """Segments of the group programs' grid: as for `_decode_segments`, shared prefixes split only until
        the grid fills the device, each group splitting its own prefix on the device within it."""
        target = self.decode_target_programs or _default_target_programs(device)
        wanted = triton.cdiv(target, max(1, num_group_slots) * num_kv_heads)
        most = min(MAX_PREFIX_SEGMENTS, triton.cdiv(longest_shared, self.decode_min_segment))
        return max(1, min(wanted, most))

    def _decode_segments(self, seq_lens: np.ndarray, num_kv_heads: int, device: torch.device) -> int:
        """Segments in the decode grid: contexts are split only until the grid fills the device, into
        segments of at least `decode_min_segment` tokens. The host plans the grid for the longest context;
        each sequence splits its own context on the device within it."""
        target = self.decode_target_programs or _default_target_programs(device)
        wanted = triton.cdiv(target, len(seq_lens) * num_kv_heads)
        most = min(MAX_SEGMENTS, triton.cdiv(int(seq_lens.max()), self.decode_min_segment))
        return max(1, min(wanted, most))


def prefill_warps_and_stages(block_m: int, head_dim: int, narrow: bool = False) -> tuple[int, int]:
    """Warps and pipeline stages of a prefill tile, from its padded width (head_dim 80 and 96 run on
    128-wide tiles: four warps would hold a 128 x 128 fp32 accumulator and spill); `narrow` tiles take two
    stages."""
    block_d = triton.next_power_of_2(head_dim)
    return (8 if block_m * block_d >= 128 * 128 else 4), (3 if block_d <= 128 and not narrow else 2)


def _narrow(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether attention tiles must narrow to fit a small shared memory (SMALL_SHARED_MEMORY): 4-byte operands, or
    heads wider than 128, on a GPU whose programs get less of it."""
    return (dtype == torch.float32 or head_dim > 128) and _shared_memory(device) < SMALL_SHARED_MEMORY


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may have on `device`, as Triton checks its launches; off a GPU, no
    limit."""
    if device.type != "cuda":
        return 2**31
    from triton.runtime import driver

    index = torch.cuda.current_device() if device.index is None else device.index
    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


@functools.cache
def _hopper(device: torch.device) -> bool:
    """A Hopper GPU (sm90, the H200 the tile table was measured on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _tile_map(query_lens: np.ndarray, seq_lens: np.ndarray, seqs: np.ndarray, block_m: int) -> np.ndarray:
    """[tiles, 2] int32 (sequence, tile index in it) of the chunks `seqs`, the tiles that see the most
    KV first, so the slowest programs start first."""
    per_seq = -(-query_lens // block_m)
    owner = np.repeat(np.arange(len(seqs)), per_seq)
    index = np.arange(owner.size) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    kv_end = (seq_lens - query_lens)[owner] + np.minimum((index + 1) * block_m, query_lens[owner])
    order = np.argsort(-kv_end, kind="stable")
    return np.stack([seqs[owner[order]], index[order]], axis=1).astype(np.int32)


def _default_target_programs(device: torch.device) -> int:
    """Two waves of programs per SM keep every SM busy; off the GPU, a small fixed figure."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16
