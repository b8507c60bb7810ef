"""Shared-prefix decode attention: each group's shared KV read once for all its decodes (cascade attention).

In a prefix-ordered job a decode step holds many groups of sequences under one system prompt or document
(16 groups of 32 decodes over a 704-token prompt in issue 38's job). The split-K decode kernel reads every
sequence's copy of its group's prefix: 12 GB of a 511-sequence step on Llama-3.2-1B's shape, against about 0.4 GB
of the sequences' own KV. Here one program takes a (sub-)group's members x the query heads of one KV head as the
rows of a matrix and a segment of the shared prefix as its keys, so each shared tile is loaded once and multiplied
as a matrix-matrix product (Hydragen, FlashInfer's cascade); it writes a partial output and its log-sum-exp per
(row, head, prefix segment). Each row's own blocks then go through the decode kernel from the row's shared length,
and the merge weighs both kinds of slots by their LSE in one pass (attention.py); when the own context is not
split (the usual decode: own contexts are short), the decode kernel does that merge itself and stores the output,
so no own partials are written and no merge kernel runs (`shared_slots`). Unlike vLLM's cascade, which splits off
one prefix common to the whole batch, any number of groups share a step.

CUDA-graph safe: the grid spans all group slots (a slot with no members computes nothing), every group is read
from the device, and each group splits its own prefix into segments on the device from its length, as the decode
kernel splits a context. Planning is on the host (`kernels/shared_prefix.group_decodes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchprefill.kernels.triton.attention import (
    LOG2E,
    MAX_PREFIX_SEGMENTS,
    SharedPrefixParts,
    _attend_tiles,
    _cache_strides,
    _segment_len,
    decode_attention,
    dot_settings,
    jit_unspecialized,
    shared_slots,
)

# Rows of a group program's query matrix (members x query heads per KV head): a sub-group holds
# SHARED_ROWS // (query heads per KV head) members, but at least MIN_MEMBERS (wider tiles for wide GQA groups),
# so every sub-group of a group of 2 or more has 2 or more members.
SHARED_ROWS = 64
MIN_MEMBERS = 4


def group_shape(heads_per_kv: int, rows: int = SHARED_ROWS) -> tuple[int, int]:
    """(members per sub-group, tile rows) for `heads_per_kv` query heads per KV head."""
    block_rows = max(rows, triton.next_power_of_2(MIN_MEMBERS * heads_per_kv))
    return block_rows // heads_per_kv, block_rows


@jit_unspecialized("stride_table", "min_segment", "num_slots")
def _shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, groups_ptr, members_ptr, seq_index_ptr,
    query_start_ptr, block_tables_ptr, qk_scale, block_size, head_dim, min_segment, num_slots,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd, stride_table,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INDEXED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: one segment of one group's shared prefix, for every member and every query head of one KV
    head (row r: member r // GROUP, head r % GROUP). `groups` rows are (first index into `members`, member
    count, shared tokens, block-table row); members are launch rows (with INDEXED, row i is sequence
    seq_index[i]). Writes each member's normalized partial output and LSE into its prefix slot `segment`."""
    group_slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    num_segments = tl.num_programs(2)
    first = tl.load(groups_ptr + 4 * group_slot)
    count = tl.load(groups_ptr + 4 * group_slot + 1)
    shared = tl.load(groups_ptr + 4 * group_slot + 2)
    table_row = tl.load(groups_ptr + 4 * group_slot + 3)
    segment_len = _segment_len(shared, num_segments, min_segment, BLOCK_N)  # 0 for an empty slot: no tiles
    lo = segment * segment_len
    hi = tl.minimum(shared, lo + segment_len)

    rows = tl.arange(0, BLOCK_R)
    member = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = member < count
    launch_row = tl.load(members_ptr + first + member, mask=row_valid, other=0)
    seq = launch_row
    if INDEXED:
        seq = tl.load(seq_index_ptr + launch_row, mask=row_valid, other=0)
    q_row = tl.load(query_start_ptr + seq, mask=row_valid, other=0)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_row[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    kv_head_offset = kv_head * stride_kh
    table_ptr = block_tables_ptr + table_row.to(tl.int64) * stride_table
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - 1e30
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(  # every key of the shared prefix precedes every member's query
        acc, m_i, l_i, q, q_row, lo, hi, hi, 0, k_cache_ptr + kv_head_offset, v_cache_ptr + kv_head_offset,
        table_ptr, dims * stride_kd, dim_valid, qk_scale, block_size, stride_kb, stride_ks, BLOCK_N, True, False,
        False, DOT_PRECISION,
    )

    l_i = tl.maximum(l_i, 1e-30)  # 0 only in a segment past the prefix end, which the merge never reads
    # Layouts as the decode kernel's split: [rows, Hq, num_slots(, BLOCK_D)], this segment's slot first.
    slot = (launch_row * tl.num_programs(1) * GROUP + heads) * num_slots + segment
    tl.store(part_lse_ptr + slot, m_i + tl.log2(l_i), mask=row_valid)
    tl.store(part_out_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc / l_i[:, None], mask=q_mask)


def shared_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, seq_index: torch.Tensor | None,
    groups: torch.Tensor, members: torch.Tensor, shared_lens: torch.Tensor, scale: float, prefix_segments: int,
    num_segments: int, min_segment: int, block_n: int, block_rows: int = SHARED_ROWS,
) -> None:
    """Decode attention for rows grouped by shared prefix: the group programs over every slot of `groups`
    ([G, 4] int32, `kernels/shared_prefix.DecodeGroups`), then the decode kernel over each row's own context
    (from `shared_lens[row]`), then one merge. Rows in no group (shared length 0) get all their context from the
    decode kernel. `prefix_segments` (at most MAX_PREFIX_SEGMENTS) splits each group's prefix, as `num_segments`
    does each row's own context; unsplit (`num_segments` 1), the decode kernel merges in registers."""
    if not 1 <= prefix_segments <= MAX_PREFIX_SEGMENTS:
        raise ValueError(f"prefix_segments must be 1-{MAX_PREFIX_SEGMENTS}, got {prefix_segments}")
    num_rows = seq_lens.shape[0] if seq_index is None else seq_index.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    heads_per_kv = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    num_slots = shared_slots(prefix_segments, num_segments)
    part_out = torch.empty(num_rows, num_heads, num_slots, block_d, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(num_rows, num_heads, num_slots, dtype=torch.float32, device=query.device)
    upcast, precision = dot_settings(query.dtype)
    _, rows = group_shape(heads_per_kv, block_rows)
    _shared_prefix_kernel[(groups.shape[0], num_kv_heads, prefix_segments)](
        query, k_cache, v_cache, part_out, part_lse, groups, members,
        seq_lens if seq_index is None else seq_index, query_start, block_tables, scale * LOG2E, k_cache.shape[1],
        head_dim, min_segment, num_slots, *query.stride(), *_cache_strides(k_cache, v_cache),
        block_tables.stride(0), GROUP=heads_per_kv, BLOCK_R=rows, BLOCK_N=block_n, BLOCK_D=block_d,
        INDEXED=seq_index is not None, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=8 if rows * block_d >= 128 * 128 else 4, num_stages=2,
    )
    decode_attention(
        query, k_cache, v_cache, out, query_start, seq_lens, block_tables, seq_index, scale, num_segments,
        min_segment, block_n, num_warps=4, num_stages=2,
        shared=SharedPrefixParts(part_out, part_lse, prefix_segments, shared_lens),
    )
