"""Shared-prefix attention for a step's decodes and short chunks, as a few padded fused calls.

In a prefix-ordered batch, many sequences of a step point at the same physical blocks for their shared
prefix (a system prompt, a document). Each group's keys are laid out once: its shared blocks, then each
member's own blocks. All the group's queries attend to that one key set in a single fused call, under a
mask that shows each query the shared part and its own blocks up to its position. A shared block is read
once per group, not once per member, and a layer runs a fixed handful of ops however many groups there are.

Groups are padded to a common size, so groups of very different sizes go to different batches, and
sequences whose own blocks outweigh what they share (long chunks under a short system prompt) stay apart:
each batch costs at most PADDING_BUDGET times its real work. The plan is built once per step, on the
host, and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.shared_prefix import by_deepest_prefix

# Padding and masked-off work stay within this multiple of the real query-key pairs: in a batch of groups,
# and inside a group, where every query scans its partners' own blocks too.
PADDING_BUDGET = 2.0
MAX_BATCH_KEY_BLOCKS = 1 << 14  # a batch gathers at most this many KV blocks (groups x padded keys), bounding memory


@dataclass
class AttentionGroup:
    """Sequences (step indices) whose first `shared` blocks are the same physical blocks."""

    shared: int
    members: list[int]
    keys: list[int]  # the group's key blocks: the shared ones, then each member's own
    own_spans: list[tuple[int, int]]  # per member: where its own blocks sit in `keys` (start, count)


@dataclass
class GroupBatch:
    """Padded groups for one fused attention call: `[NG]` groups of up to M members, W queries each."""

    rows: torch.Tensor  # [NG, M, W] flat-batch row of each query (padding repeats a real one)
    real: torch.Tensor | None  # positions of the real queries in rows.flatten(); None when nothing is padding
    real_rows: torch.Tensor  # their flat-batch rows
    key_blocks: torch.Tensor  # [NG, B] block ids, padded with block 0
    mask: torch.Tensor  # [NG, 1, M*G*W, B*block] additive: 0 where a query sees the key, -inf where not


def find_groups(meta: AttentionMetadata, seqs: list[int], tables: list[list[int]], block: int) -> list[AttentionGroup]:
    """Group the sequences by the deepest run of leading blocks they share with another sequence of the set.

    Only blocks wholly before a sequence's first query count as shared: the block it is writing is its own.
    In a prefix-ordered batch the deepest shared level is a document under a system prompt, not just the
    system prompt. A sequence that shares nothing is a group of its own.
    """
    groups = []
    for prefix, members in by_deepest_prefix(meta, seqs, tables, block).items():
        alone = [_group_of((), [s], meta, tables, block) for s in members]
        if len(members) > 1:
            # Every query of a group scans all its keys, its partners' own blocks included (masked): worth it
            # only while the shared part outweighs the partners' (decodes, short questions), not for long chunks.
            group = _group_of(prefix, members, meta, tables, block)
            if _pairs(group, meta) <= PADDING_BUDGET * sum(_pairs(g, meta) for g in alone):
                groups.append(group)
                continue
        groups += alone
    return groups


def _group_of(prefix: tuple[int, ...], members: list[int], meta: AttentionMetadata, tables: list[list[int]],
              block: int) -> AttentionGroup:
    keys, spans = list(prefix), []
    for s in members:
        own = tables[s][len(prefix) : cdiv(meta.seq_lens_host[s], block)]
        spans.append((len(keys), len(own)))
        keys += own
    return AttentionGroup(len(prefix), members, keys, spans)


def _pairs(group: AttentionGroup, meta: AttentionMetadata) -> int:
    """Query-key block pairs a group's fused call computes for its real queries."""
    return sum(meta.query_lens_host[s] for s in group.members) * len(group.keys)


def batch_groups(groups: list[AttentionGroup], meta: AttentionMetadata) -> list[list[AttentionGroup]]:
    """Split groups into batches whose padding stays within PADDING_BUDGET of their real work and whose
    gathered keys stay within MAX_BATCH_KEY_BLOCKS (a group larger than that is a batch of its own)."""

    def width(g: AttentionGroup) -> int:
        return max(meta.query_lens_host[s] for s in g.members)

    def cost(g: AttentionGroup) -> int:
        return len(g.members) * width(g) * len(g.keys)

    batches: list[list[AttentionGroup]] = []
    shape, real = (0, 0, 0), 0  # the current batch's largest (members, width, keys), and its real work
    for group in sorted(groups, key=cost):
        grown = tuple(max(a, b) for a, b in zip(shape, (len(group.members), width(group), len(group.keys))))
        key_blocks = (len(batches[-1]) + 1) * grown[2] if batches else 0
        if (batches and grown[0] * grown[1] * key_blocks <= PADDING_BUDGET * (real + cost(group))
                and key_blocks <= MAX_BATCH_KEY_BLOCKS):
            batches[-1].append(group)
            shape, real = grown, real + cost(group)
        else:
            batches.append([group])
            shape, real = (len(group.members), width(group), len(group.keys)), cost(group)
    return batches


def pad_batch(batch: list[AttentionGroup], meta: AttentionMetadata, block: int, heads_per_kv: int, dtype: torch.dtype,
            device: torch.device) -> GroupBatch:
    """The index tensors and mask of one batch of groups."""
    num_groups = len(batch)
    members = max(len(g.members) for g in batch)
    width = max(meta.query_lens_host[s] for g in batch for s in g.members)
    num_keys = max(len(g.keys) for g in batch) * block
    query_start = meta.query_start.tolist()
    rows = np.zeros((num_groups, members, width), dtype=np.int64)
    keep = np.zeros((num_groups, members, width), dtype=bool)
    visible = np.zeros((num_groups, members, width, num_keys), dtype=bool)
    key_blocks = np.zeros((num_groups, num_keys // block), dtype=np.int64)
    for g, group in enumerate(batch):
        key_blocks[g, : len(group.keys)] = group.keys
        for m in range(members):
            real = m < len(group.members)
            s = group.members[min(m, len(group.members) - 1)]  # padding members repeat the last real one
            q_len, seq_len = meta.query_lens_host[s], meta.seq_lens_host[s]
            offsets = np.minimum(np.arange(width), q_len - 1)
            rows[g, m] = query_start[s] + offsets
            keep[g, m] = real & (np.arange(width) < q_len)
            positions = seq_len - q_len + offsets  # absolute position of each query
            visible[g, m, :, : group.shared * block] = True
            start, count = group.own_spans[min(m, len(group.members) - 1)]
            own_positions = group.shared * block + np.arange(count * block)  # absolute position of each own key
            visible[g, m, :, start * block : (start + count) * block] = own_positions[None, :] <= positions[:, None]
    # query rows are (member, head in group, query): the mask repeats over the heads that share a KV head
    visible = np.repeat(visible[:, :, None], heads_per_kv, axis=2).reshape(num_groups, 1, -1, num_keys)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~torch.from_numpy(visible).to(device), float("-inf"))
    to = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    real = np.flatnonzero(keep)
    return GroupBatch(rows=to(rows), real=None if keep.all() else to(real), real_rows=to(rows.reshape(-1)[real]),
                      key_blocks=to(key_blocks), mask=mask)


def group_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                    batch: GroupBatch, out: torch.Tensor) -> None:
    """One fused attention call for a batch of groups; writes each real query's result into `out`."""
    num_groups, members, width = batch.rows.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads_per_kv = query.shape[1] // num_kv_heads
    q = query[batch.rows].view(num_groups, members, width, num_kv_heads, heads_per_kv, head_dim)
    q = q.permute(0, 3, 1, 4, 2, 5).reshape(num_groups, num_kv_heads, -1, head_dim)  # rows (member, head, query)
    blocks = batch.key_blocks.flatten()
    keys = k_cache.index_select(0, blocks).view(num_groups, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, blocks).view(num_groups, -1, num_kv_heads, head_dim).transpose(1, 2)
    result = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=batch.mask,
                                            scale=scale)
    result = result.view(num_groups, num_kv_heads, members, heads_per_kv, width, head_dim)
    result = result.permute(0, 2, 4, 1, 3, 5).reshape(num_groups * members * width, -1, head_dim)
    if batch.real is not None:
        result = result.index_select(0, batch.real)
    out.index_copy_(0, batch.real_rows, result.to(out.dtype))
