"""Decode attention on the CPU where the in-place kernel (kernels/native/paged_decode.py) is not built, and its
reference: each shared prefix read once per group, and no query scanning another's blocks.

A step's decodes are keyed by the deepest prefix blocks they share (`shared_prefix.by_deepest_prefix`).
Attention then runs as two batched fused calls and a log-sum-exp merge:
- shared: each group's queries (members x query heads of a KV head, as rows) against the group's shared
  blocks only. Every member sees the whole shared prefix, so the only mask is padding to the longest prefix
  of the batch;
- own: each decode's queries against its own blocks (those after its group's shared ones), padded to the
  longest;
- merged row by row by log-sum-exp.
So each query scores its real context plus padding. Group attention under one dense mask (prefix_groups.py)
scored every partner's own blocks too and built a mask of members x heads x keys per group, which with long
outputs grows every step: 3x the scores and a 15 MB mask per step at 80 decodes in 9 groups of 128-token
answers (benchmarks/cpu/cpu_ops.py has the side-by-side figure).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.shared_prefix import by_deepest_prefix
from batchprefill.kernels.torch.prefix_groups import PADDING_BUDGET

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class SharedBatch:
    """Groups whose shared prefixes run in one call: `[NG]` groups of up to M members."""

    members: torch.Tensor  # [NG, M] index into the plan's decodes (padding repeats a real member)
    blocks: torch.Tensor  # [NG, P] shared block ids, padded with block 0
    mask: torch.Tensor  # [NG, 1, 1, P*block] additive: 0 on a real shared key, -inf on padding
    real: torch.Tensor  # positions in members.flatten() that are real members
    decodes: torch.Tensor  # the plan's decode index of each of those


@dataclass(frozen=True)
class DecodePlan:
    rows: torch.Tensor  # [S] flat-batch row of each decode
    own_blocks: torch.Tensor  # [S, O] each decode's own block ids, padded with block 0
    own_mask: torch.Tensor  # [S, 1, 1, O*block] additive: 0 up to the decode's position, -inf after
    shared: list[SharedBatch]

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:
        decode_attention(query, k_cache, v_cache, scale, self, out)


def plan_decodes(meta: AttentionMetadata, decodes: list[int], tables: list[list[int]], block: int,
                 dtype: torch.dtype, device: torch.device) -> DecodePlan | None:
    """The index tensors and padding masks of a step's decodes, built once for every layer."""
    if not decodes:
        return None
    index = {s: i for i, s in enumerate(decodes)}
    shared_of = np.zeros(len(decodes), dtype=np.int64)  # shared blocks of each decode's group
    groups = []
    for prefix, members in by_deepest_prefix(meta, decodes, tables, block).items():
        if prefix and len(members) > 1:
            groups.append((prefix, [index[s] for s in members]))
            shared_of[[index[s] for s in members]] = len(prefix)
    seq_lens = np.array([meta.seq_lens_host[s] for s in decodes], dtype=np.int64)
    own_tokens = seq_lens - shared_of * block
    own_width = int(cdiv(int(own_tokens.max()), block))
    own_blocks = np.zeros((len(decodes), own_width), dtype=np.int64)
    for i, s in enumerate(decodes):
        own = tables[s][shared_of[i] : cdiv(int(seq_lens[i]), block)]
        own_blocks[i, : len(own)] = own
    visible = np.arange(own_width * block)[None, :] < own_tokens[:, None]
    query_start = np.cumsum([0, *meta.query_lens_host])
    to = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    return DecodePlan(rows=to(query_start[decodes].astype(np.int64)), own_blocks=to(own_blocks),
                      own_mask=_additive(visible, dtype, device)[:, None, None, :],
                      shared=[_shared_batch(batch, block, dtype, device) for batch in _batches(groups)])


def _batches(groups: list[tuple[tuple[int, ...], list[int]]]) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """Groups sorted by size, split where padding to the batch's largest would exceed PADDING_BUDGET."""
    batches: list[list] = []
    most_members = most_blocks = real = 0
    for group in sorted(groups, key=lambda g: len(g[0]) * len(g[1])):
        members, blocks = max(most_members, len(group[1])), max(most_blocks, len(group[0]))
        work = len(group[0]) * len(group[1])
        if batches and (len(batches[-1]) + 1) * members * blocks <= PADDING_BUDGET * (real + work):
            batches[-1].append(group)
            most_members, most_blocks, real = members, blocks, real + work
        else:
            batches.append([group])
            most_members, most_blocks, real = len(group[1]), len(group[0]), work
    return batches


def _shared_batch(batch: list, block: int, dtype: torch.dtype, device: torch.device) -> SharedBatch:
    width = max(len(members) for _, members in batch)
    depth = max(len(prefix) for prefix, _ in batch)
    members = np.zeros((len(batch), width), dtype=np.int64)
    real = np.zeros((len(batch), width), dtype=bool)
    blocks = np.zeros((len(batch), depth), dtype=np.int64)
    visible = np.zeros((len(batch), depth * block), dtype=bool)
    for g, (prefix, group_members) in enumerate(batch):
        members[g] = group_members[-1]
        members[g, : len(group_members)] = group_members
        real[g, : len(group_members)] = True
        blocks[g, : len(prefix)] = prefix
        visible[g, : len(prefix) * block] = True
    positions = np.flatnonzero(real)
    to = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    return SharedBatch(members=to(members), blocks=to(blocks),
                       mask=_additive(visible, dtype, device)[:, None, None, :], real=to(positions),
                       decodes=to(members.reshape(-1)[positions]))


def _additive(visible: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~torch.from_numpy(visible).to(device), float("-inf"))


def _keys(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, Hkv, blocks*block, D]` keys or values of `[B, n]` block ids, in one gather."""
    count, width = blocks.shape
    gathered = cache.index_select(0, blocks.reshape(-1)).view(count, width * cache.shape[1], *cache.shape[2:])
    return gathered.transpose(1, 2).to(dtype)


def gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
             mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Query sets `[items, Hkv, rows, D]` over their blocks `[items, width]` gathered into a padded copy, then one
    fused call under the padding mask `[items, 1, 1, width*block]`: (output, log-sum-exp `[items, Hkv, rows]`).
    The fused call with a log-sum-exp is torch's CPU kernel; on a GPU (this backend as the reference there) the
    same in plain float32 ops."""
    keys, values = _keys(k_cache, blocks, q.dtype), _keys(v_cache, blocks, q.dtype)
    if q.device.type == "cpu":
        return _flash(q, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    return attention_with_lse(q, keys, values, mask, scale)


def attention_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_flash`'s (output, natural log-sum-exp) in float32 matmuls and a softmax, on any device."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), values.float()).to(q.dtype), lse


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                     plan: DecodePlan, out: torch.Tensor) -> None:
    """Writes every planned decode's attention `[Hq, D]` into `out` at its flat-batch row."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    count = plan.rows.shape[0]
    per_kv = query.shape[1] // num_kv_heads
    q = query.index_select(0, plan.rows).view(count, num_kv_heads, per_kv, head_dim)
    result, lse = gathered(q, k_cache, v_cache, plan.own_blocks, plan.own_mask, scale)
    for batch in plan.shared:
        groups, members = batch.members.shape
        grouped = q.index_select(0, batch.members.reshape(-1)).view(groups, members, num_kv_heads, per_kv, head_dim)
        grouped = grouped.transpose(1, 2).reshape(groups, num_kv_heads, members * per_kv, head_dim)
        shared, shared_lse = gathered(grouped, k_cache, v_cache, batch.blocks, batch.mask, scale)
        shared = shared.view(groups, num_kv_heads, members, per_kv, head_dim).transpose(1, 2)
        shared = shared.reshape(groups * members, num_kv_heads, per_kv, head_dim).index_select(0, batch.real)
        shared_lse = shared_lse.view(groups, num_kv_heads, members, per_kv).transpose(1, 2)
        shared_lse = shared_lse.reshape(groups * members, num_kv_heads, per_kv).index_select(0, batch.real)
        own, own_lse = result.index_select(0, batch.decodes), lse.index_select(0, batch.decodes)
        total = torch.logaddexp(own_lse, shared_lse)
        merged = own * torch.exp(own_lse - total)[..., None] + shared * torch.exp(shared_lse - total)[..., None]
        result = result.index_copy(0, batch.decodes, merged.to(result.dtype))
    out.index_copy_(0, plan.rows, result.reshape(count, -1, head_dim).to(out.dtype))
