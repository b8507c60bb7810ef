"""Paged attention kernels: one prefill kernel for ragged mixed batches, split-K decode with an LSE merge.

Kernels read sequence lengths and offsets from the device; host copies only size grids, so a decode
launch sized for longer contexts than the real ones still computes the right thing, and splits each
context into segments from its true length.

Batch invariance (`engine.batch_invariant`, `TritonOps`): the prefill kernel walks a query row's keys in
`BLOCK_N` tiles at absolute positions from 0 (from the window's tile under a window), so with BLOCK_M and
BLOCK_N fixed a row's online softmax is one fixed sequence of tile updates whatever chunk or tile it sits in.
A tile the row cannot see at all leaves its state exactly as it was (its scores are -inf: the maximum, the
sum and the accumulator come out unchanged), so the tiles a neighbour row adds to the walk change nothing.
What can still differ is the arithmetic of a tile the row sees in full: it runs unmasked or masked depending
on where its tile's first row sits, and on a GPU the two variants need not round alike (a select between the
scale and the exponent may keep the compiler from fusing them). `MASK_ALL` masks every tile, so there is one
variant. The decode kernel's tiles (a GQA group's heads as the rows, segments, a window's first tile at
`seq_len - window`) differ from the prefill kernel's, so an invariant step sends its decodes through the
prefill kernel too, as 1-row tiles.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The merge kernel holds every segment of one head in registers at once, always this many wide (masked), so
# the split depth, which changes from step to step, never compiles a new variant.
MAX_SEGMENTS = 64
# The same for the shared-prefix segments of a decode group (shared_decode.py), merged in the same pass.
MAX_PREFIX_SEGMENTS = 16


@dataclass
class SharedPrefixParts:
    """Where the shared-prefix decode (shared_decode.py) left each row's prefix partials: `out` [rows, Hq, slots,
    BLOCK_D] and `lse` [rows, Hq, slots] (float32), the first `prefix_slots` slots of each row and head; the rest
    (`shared_slots`) are the row's own segments when its context is split. `lens` [rows] int32: shared tokens of
    each row (0: in no group)."""

    out: torch.Tensor
    lse: torch.Tensor
    prefix_slots: int
    lens: torch.Tensor


def shared_slots(prefix_slots: int, num_segments: int) -> int:
    """Partial slots per (row, head) of a shared-prefix decode: the prefix segments', plus the own segments' only
    when the own context is split. Unsplit (the usual decode: own contexts are short), the decode kernel merges
    the prefix partials into its own result in registers, so it writes no own partials and no merge kernel runs:
    at 16 groups x 32 decodes (Llama-3.2-1B heads) that merge was 16,384 programs re-reading every slot."""
    return prefix_slots + (num_segments if num_segments > 1 else 0)


def jit_unspecialized(*names: str) -> Callable:
    """`triton.jit` that never specializes `names` (on == 1 or on 16-divisibility): arguments that change
    from step to step would otherwise compile a new variant in the middle of a run. Triton 3.2 and later
    (so 3.6 to 3.9) take both keywords; the signature check keeps an older one importable."""
    accepted = inspect.signature(triton.jit).parameters
    keywords = ("do_not_specialize", "do_not_specialize_on_alignment")
    return triton.jit(**{key: list(names) for key in keywords if key in accepted})


def interpreting() -> bool:
    """True under Triton's CPU interpreter, whose bf16 `tl.dot` is wrong: there, dots run in fp32."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def load_kv(pointers, mask, dtype: tl.constexpr):
    """A tile of K or V from the pool in the compute `dtype`, masked lanes zero: an FP8 pool's bytes are widened
    here, in registers (kernels/fp8_kv.py: scale 1.0 per tensor, so the widened value is the value), so every kernel
    that reads the pool through this takes FP8 pools as it takes 16-bit ones, and reads half the bytes."""
    return tl.load(pointers, mask=mask, other=0.0).to(dtype)


@triton.jit
def _kv_offsets(table_ptr, kv_pos, kv_valid, block_size, stride_block, stride_slot):
    """Cache offsets of the KV rows at `kv_pos`, each looked up in the block table on its own, so a tile
    may span several blocks or part of one."""
    block = tl.load(table_ptr + kv_pos // block_size, mask=kv_valid, other=0).to(tl.int64)
    return block * stride_block + (kv_pos % block_size) * stride_slot


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, lo, hi, end, window, k_ptr, v_ptr, table_ptr, dim_offs, dim_valid, qk_scale,
    block_size, stride_block, stride_slot,
    BLOCK_N: tl.constexpr, MASK_END: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the query rows `q` over the KV tiles [lo, hi), keys at or past `end` never loaded: the
    one tile loop of the prefill, decode and shared-prefix kernels. MASK_END gives keys past `end` no weight
    (a tile that may cross it); CAUSAL (with MASK_END) also those after each row's position `q_pos`, and with
    SLIDING those outside its window (a query at p sees keys above p - window). Unmasked, every key in
    [lo, hi) counts: the prefill kernel's tiles that every row of its tile sees in full."""
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < end
        rows = _kv_offsets(table_ptr, kv_pos, kv_valid, block_size, stride_block, stride_slot)
        tile_mask = kv_valid[:, None] & dim_valid[None, :]
        k = load_kv(k_ptr + rows[:, None] + dim_offs[None, :], tile_mask, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASK_END:
            visible = kv_valid[None, :]
            if CAUSAL:
                visible = visible & (kv_pos[None, :] <= q_pos[:, None])
                if SLIDING:
                    visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(v_ptr + rows[:, None] + dim_offs[None, :], tile_mask, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@jit_unspecialized("stride_table")
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tile_map_ptr,
    query_start_ptr, seq_lens_ptr, block_tables_ptr, qk_scale, block_size, head_dim, window,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_table,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr, MASK_ALL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_M query rows of one sequence, one query head, over all KV it may see.
    `tile_map` is [tiles, 2] (sequence, tile index in it), one pointer whose alignment never changes.
    MASK_ALL masks every KV tile, so a row's arithmetic does not depend on its tile's first row."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_map_ptr + 2 * tile)
    first_row = tl.load(tile_map_ptr + 2 * tile + 1) * BLOCK_M
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + first_row  # absolute position of the tile's first query row

    rows = first_row + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = seq_len - q_len + rows

    kv_head_offset = (head // GROUP) * stride_kh
    k_ptr = k_cache_ptr + kv_head_offset
    v_ptr = v_cache_ptr + kv_head_offset
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    dim_offs = dims * stride_kd
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1e30  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Tiles every row of this tile sees in full need no mask; the rest stop at the last row's position.
    # Under a window, the tiles start at the first row's window and are all masked.
    if SLIDING:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_end = lo
    elif MASK_ALL:
        lo = 0
        unmasked_end = 0
    else:
        lo = 0
        unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    end = tl.minimum(seq_len, first_pos + BLOCK_M)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, lo, unmasked_end, seq_len, window, k_ptr, v_ptr, table_ptr, dim_offs, dim_valid,
        qk_scale, block_size, stride_kb, stride_ks, BLOCK_N, False, False, SLIDING, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, unmasked_end, end, seq_len, window, k_ptr, v_ptr, table_ptr, dim_offs,
        dim_valid, qk_scale, block_size, stride_kb, stride_ks, BLOCK_N, True, True, SLIDING, DOT_PRECISION,
    )

    out = acc / l_i[:, None]
    o_offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _segment_len(seq_len, num_segments, min_segment, BLOCK_N: tl.constexpr):
    """Tokens per segment of one sequence, planned on the device from its own length: as many segments as
    the grid has (at most), each of at least `min_segment` tokens and a whole number of KV tiles. A grid
    sized for the longest context a CUDA graph may meet (33 segments at 131k tokens, batch 1) then still
    splits a 2k-token context into 8 segments of 256, not one."""
    wanted = tl.maximum(1, tl.minimum(num_segments, tl.cdiv(seq_len, min_segment)))
    return tl.cdiv(tl.cdiv(seq_len, wanted), BLOCK_N) * BLOCK_N


@triton.jit
def _launch_row_context(launch_row, seq_index_ptr, shared_lens_ptr, query_start_ptr, seq_lens_ptr,
                        INDEXED: tl.constexpr, SHARED: tl.constexpr):
    """(sequence, context length, query row, shared-prefix tokens) of a decode or merge launch row: with INDEXED
    the row serves sequence seq_index[row], with SHARED its first shared_lens[row] tokens are its group's (else 0)."""
    seq = launch_row
    if INDEXED:
        seq = tl.load(seq_index_ptr + launch_row)
    shared = 0
    if SHARED:
        shared = tl.load(shared_lens_ptr + launch_row)
    return seq, tl.load(seq_lens_ptr + seq), tl.load(query_start_ptr + seq), shared


@jit_unspecialized("stride_table", "min_segment", "prefix_slots")
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, seq_index_ptr, shared_lens_ptr,
    query_start_ptr, seq_lens_ptr, block_tables_ptr, qk_scale, block_size, head_dim, min_segment, window,
    prefix_slots, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_table,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, SPLIT: tl.constexpr, INDEXED: tl.constexpr, SLIDING: tl.constexpr,
    SHARED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: one segment of one sequence's context for all query heads of one KV head, so each
    KV tile is read once per GQA group. With SPLIT it writes a normalized partial output and its LSE.
    With INDEXED, launch row i serves sequence seq_index[i] (the single-token rows of a mixed step).
    With SHARED, launch row i walks only its own context, from shared_lens[i] (what its group's program in
    shared_decode.py reads once for all members) to its end: with SPLIT into the slots after the `prefix_slots`
    ones, without it merged at once with the row's prefix slots into `out` (`_merge_prefix_slots`)."""
    launch_row = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    num_segments = tl.num_programs(2)
    seq, seq_len, row, shared = _launch_row_context(launch_row, seq_index_ptr, shared_lens_ptr, query_start_ptr,
                                                    seq_lens_ptr, INDEXED, SHARED)
    segment_len = _segment_len(seq_len - shared, num_segments, min_segment, BLOCK_N)
    lo = shared + segment * segment_len
    hi = tl.minimum(seq_len, lo + segment_len)
    if SLIDING:  # the query at seq_len - 1 sees its last `window` positions; earlier segments stay empty
        lo = tl.maximum(lo, seq_len - window)

    group = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group
    head_valid = group < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    q_mask = head_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    kv_head_offset = kv_head * stride_kh
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - 1e30
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(  # the window moved `lo`: every key left in [lo, hi) is visible
        acc, m_i, l_i, q, seq_len - 1, lo, hi, hi, window, k_cache_ptr + kv_head_offset,
        v_cache_ptr + kv_head_offset, table_ptr, dims * stride_kd, dim_valid, qk_scale, block_size, stride_kb,
        stride_ks, BLOCK_N, True, False, False, DOT_PRECISION,
    )

    l_i = tl.maximum(l_i, 1e-30)  # 0 only in a segment past the sequence end, which the merge never reads
    out = acc / l_i[:, None]
    if SPLIT:
        # Layouts: part_out [S, Hq, prefix_slots + num_segments, BLOCK_D], part_lse [S, Hq, prefix_slots +
        # num_segments]; prefix_slots is 0 unless SHARED.
        slots = prefix_slots + num_segments
        slot = (launch_row * tl.num_programs(1) * GROUP + heads) * slots + prefix_slots + segment
        tl.store(part_lse_ptr + slot, m_i + tl.log2(l_i), mask=head_valid)
        tl.store(part_out_ptr + slot[:, None] * BLOCK_D + dims[None, :], out, mask=q_mask)
    else:
        if SHARED:  # unsplit: part_out [S, Hq, prefix_slots, BLOCK_D] holds only the prefix slots
            first_slot = (launch_row * tl.num_programs(1) * GROUP + heads) * prefix_slots
            out = _merge_prefix_slots(out, m_i + tl.log2(l_i), hi > lo, part_out_ptr, part_lse_ptr, first_slot,
                                      head_valid, dims, dim_valid, shared, prefix_slots, min_segment, BLOCK_N,
                                      BLOCK_P, BLOCK_D)
        o_offs = row * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _slot_weights(lse_ptr, slots, valid, top):
    """2^(lse - top) of each valid slot, 0 for the others (an empty segment, a row's missing prefix)."""
    lse = tl.load(lse_ptr + slots, mask=valid, other=float("-inf"))
    return tl.where(valid, tl.exp2(lse - top), 0.0)


@triton.jit
def _merge_prefix_slots(
    out, lse, own_valid, part_out_ptr, part_lse_ptr, first_slot, head_valid, dims, dim_valid, shared, prefix_slots,
    min_segment, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """A decode program's own result (normalized `out` [BLOCK_G, BLOCK_D], its `lse` [BLOCK_G], valid if it saw
    any own token) merged with its row's prefix slots from `first_slot` [BLOCK_G], each weighted by 2^(lse - top)
    as `_merge_kernel` weighs slots. Only the slots the group's programs filled are read: as many as its prefix
    splits into (`_segment_len`, as they split it), none for a row in no group (shared length 0)."""
    num_prefix = tl.cdiv(shared, tl.maximum(_segment_len(shared, prefix_slots, min_segment, BLOCK_N), 1))
    prefix = tl.arange(0, BLOCK_P)
    prefix_valid = head_valid[:, None] & (prefix < num_prefix)[None, :]
    prefix_lse = tl.load(part_lse_ptr + first_slot[:, None] + prefix[None, :], mask=prefix_valid,
                         other=float("-inf"))
    top = tl.maximum(tl.where(own_valid, lse, float("-inf")), tl.max(prefix_lse, 1))
    own_weight = tl.where(own_valid, tl.exp2(lse - top), 0.0)
    mass = own_weight + tl.sum(tl.where(prefix_valid, tl.exp2(prefix_lse - top[:, None]), 0.0), 1)
    total = out * own_weight[:, None]
    for index in range(0, num_prefix):
        slot = first_slot + index
        part = tl.load(part_out_ptr + slot[:, None] * BLOCK_D + dims[None, :],
                       mask=head_valid[:, None] & dim_valid[None, :], other=0.0)
        total += part * _slot_weights(part_lse_ptr, slot, head_valid, top)[:, None]
    return total / mass[:, None]


@jit_unspecialized("min_segment", "num_segments", "prefix_slots")
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, seq_index_ptr, shared_lens_ptr, query_start_ptr, seq_lens_ptr, min_segment,
    num_segments, prefix_slots, head_dim, stride_ot, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INDEXED: tl.constexpr, SHARED: tl.constexpr,
):
    """Combine one head's segment outputs, each weighted by its share of the softmax mass (2^lse). With SHARED
    the row's first `prefix_slots` slots hold its group's shared-prefix segments (none valid for a row in no
    group), merged in the same pass as its own segments."""
    launch_row = tl.program_id(0)
    head = tl.program_id(1)
    _, seq_len, row, shared = _launch_row_context(launch_row, seq_index_ptr, shared_lens_ptr, query_start_ptr,
                                                  seq_lens_ptr, INDEXED, SHARED)
    own = seq_len - shared
    segments = tl.arange(0, BLOCK_S)
    seg_valid = segments < tl.cdiv(own, _segment_len(own, num_segments, min_segment, BLOCK_N))
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    first_slot = (launch_row * tl.num_programs(1) + head) * (prefix_slots + num_segments)
    slot = first_slot + prefix_slots + segments
    top = tl.max(tl.load(part_lse_ptr + slot, mask=seg_valid, other=float("-inf")), 0)
    if SHARED:
        prefix = tl.arange(0, BLOCK_P)
        prefix_len = tl.maximum(_segment_len(shared, prefix_slots, min_segment, BLOCK_N), 1)
        prefix_valid = prefix < tl.cdiv(shared, prefix_len)
        top = tl.maximum(top, tl.max(tl.load(part_lse_ptr + first_slot + prefix, mask=prefix_valid,
                                             other=float("-inf")), 0))
    weight = _slot_weights(part_lse_ptr, slot, seg_valid, top)
    parts = tl.load(part_out_ptr + slot[:, None] * BLOCK_D + dims[None, :],
                    mask=seg_valid[:, None] & dim_valid[None, :], other=0.0)
    total = tl.sum(parts * weight[:, None], 0)
    mass = tl.sum(weight, 0)
    if SHARED:
        prefix_weight = _slot_weights(part_lse_ptr, first_slot + prefix, prefix_valid, top)
        prefix_parts = tl.load(part_out_ptr + (first_slot + prefix)[:, None] * BLOCK_D + dims[None, :],
                               mask=prefix_valid[:, None] & dim_valid[None, :], other=0.0)
        total += tl.sum(prefix_parts * prefix_weight[:, None], 0)
        mass += tl.sum(prefix_weight, 0)
    o_offs = row * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_offs, (total / mass).to(out_ptr.dtype.element_ty), mask=dim_valid)


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast dot operands to fp32, input precision). fp32 dots run as TF32 when torch's own fp32 matmul
    precision allows it (`torch.set_float32_matmul_precision("high")`, the switch the linear layers follow);
    exact fp32 dots spill registers on the GPU, so the caller then uses narrower KV tiles, and we warn once."""
    if interpreting():
        return True, "ieee"
    if dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest":
        return False, "tf32"  # the precision only matters for fp32 operands
    _warn_exact_fp32()
    return False, "ieee"


_warned_exact_fp32 = []


def _warn_exact_fp32() -> None:
    if not _warned_exact_fp32:
        _warned_exact_fp32.append(True)
        warnings.warn("fp32 attention on the GPU runs exact (IEEE) dots on narrow tiles, several times slower "
                      "than TF32: use model.dtype=bfloat16, or torch.set_float32_matmul_precision('high')",
                      stacklevel=3)


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    return k_cache.stride()


def prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, tile_map: torch.Tensor,
    scale: float, block_m: int, block_n: int, num_warps: int, num_stages: int, window: int | None = None,
    mask_all: bool = False,
) -> None:
    """Launch the prefill kernel; `tile_map` [tiles, 2] holds each tile's sequence and index in it.
    `mask_all` masks every KV tile (batch-invariant steps)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    upcast, precision = dot_settings(query.dtype)
    grid = (tile_map.shape[0], num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, tile_map, query_start, seq_lens, block_tables,
        scale * LOG2E, k_cache.shape[1], head_dim, window or 0, *query.stride(), *out.stride(),
        *_cache_strides(k_cache, v_cache), block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), SLIDING=window is not None, MASK_ALL=mask_all, UPCAST=upcast,
        DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, seq_index: torch.Tensor | None,
    scale: float, num_segments: int, min_segment: int, block_n: int, num_warps: int, num_stages: int,
    window: int | None = None, shared: SharedPrefixParts | None = None,
) -> None:
    """Launch the decode kernel over (sequence, KV head, segment), then the merge when split (`num_segments` > 1).

    `seq_index` lists the sequences to serve (the decodes of a mixed step); None serves every sequence.
    Each sequence splits its own context on the device into at most `num_segments` segments of at least
    `min_segment` tokens. With `shared` (shared_decode.py), each row walks only the context after its shared
    prefix, whose partial results are already in `shared`'s buffers (`shared_slots` wide), and the merge takes
    both; unsplit, the decode kernel merges them itself (no own partials, no merge launch)."""
    num_rows = seq_lens.shape[0] if seq_index is None else seq_index.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    split = num_segments > 1  # on the host, from the grid: fixed for a captured graph
    indexed = seq_index is not None
    seq_index = seq_lens if seq_index is None else seq_index  # a placeholder pointer when not indexed
    part_out = part_lse = out  # unused placeholders when not split
    prefix_slots, shared_lens = 0, seq_lens  # the placeholder pointer is never read without SHARED
    if shared is not None:
        if window is not None:
            raise ValueError("the shared-prefix decode has no sliding window: plan such layers without groups")
        part_out, part_lse, prefix_slots, shared_lens = shared.out, shared.lse, shared.prefix_slots, shared.lens
        if part_lse.shape[2] != shared_slots(prefix_slots, num_segments):
            raise ValueError(f"shared-prefix partials have {part_lse.shape[2]} slots, the launch needs "
                             f"{shared_slots(prefix_slots, num_segments)}")
    elif split:
        part_out = torch.empty(num_rows, num_heads, num_segments, block_d, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_rows, num_heads, num_segments, dtype=torch.float32, device=query.device)
    upcast, precision = dot_settings(query.dtype)
    _decode_kernel[(num_rows, num_kv_heads, num_segments)](
        query, k_cache, v_cache, out, part_out, part_lse, seq_index, shared_lens, query_start, seq_lens,
        block_tables, scale * LOG2E, k_cache.shape[1], head_dim, min_segment, window or 0, prefix_slots,
        *query.stride(), *out.stride(), *_cache_strides(k_cache, v_cache), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_P=MAX_PREFIX_SEGMENTS, SPLIT=split, INDEXED=indexed, SLIDING=window is not None,
        SHARED=shared is not None, UPCAST=upcast,
        DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_kernel[(num_rows, num_heads)](
            part_out, part_lse, out, seq_index, shared_lens, query_start, seq_lens, min_segment, num_segments,
            prefix_slots, head_dim, *out.stride(), BLOCK_S=MAX_SEGMENTS, BLOCK_P=MAX_PREFIX_SEGMENTS,
            BLOCK_N=block_n, BLOCK_D=block_d, INDEXED=indexed, SHARED=shared is not None,
        )
