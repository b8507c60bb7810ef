"""The ops the model calls, their metadata, and the plain torch implementation.

Every backend implements the same five functions with the same tensor layouts, so the model never
knows which one runs. The torch path is both the CPU path and the reference the Triton kernels are
tested against.

Layouts:
- flat batch: all query tokens of a step in one dimension `T` (prefill chunks and decodes mixed);
- KV cache of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, one tensor for K, one for V;
- a token's cache slot is `block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its KV lives in the pool."""

    query_start: torch.Tensor  # [S+1] int32: sequence s owns queries query_start[s]:query_start[s+1]
    seq_lens: torch.Tensor  # [S] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    query_lens_host: list[int]  # host copies, so no backend has to sync the device to loop
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_host)


class Ops(Protocol):
    """What a compute backend provides to the model."""

    graph_safe_decode: bool  # a decode-only step launches fixed grids with no host sync: CUDA graphs can replay it

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key/value `[T, Hkv, D]` into the paged caches at `slot_mapping` `[T]`."""

    def attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal paged attention for a flat batch: query `[T, Hq, D]` -> `[T, Hq, D]`.

        Query j of sequence s sits at absolute position `seq_len - query_len + j` and attends to every
        cached position up to and including its own. Hq is a multiple of Hkv (GQA).
        """

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm with the residual add fused in: returns (norm(x + residual) * weight, x + residual).

        With no residual, the second value is x itself.
        """

    def rope(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE on query `[T, Hq, D]` and key `[T, Hkv, D]`.

        `cos_sin` is `[max_positions, D]`: the first D/2 columns are cos, the last D/2 sin.
        """


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The `[max_positions, head_dim]` cos|sin table for rotate-half RoPE, in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (long wavelengths stretched, short ones kept)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((original / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(middle, blended, scaled)


SHORT_CHUNK = 64  # chunks up to this many queries share one padded attention call


@dataclass
class CascadePlan:
    """How a batch of short chunks splits its attention between shared prefixes and own blocks."""

    own_blocks: list[list[int]]  # per sequence: its blocks after the shared part, padded with block 0
    first_own_block: list[int]  # per sequence: index of its first own block in its table
    groups: list[tuple[list[int], list[int]]]  # (member rows, shared block ids)


def _padded_rows(meta: AttentionMetadata, seqs: list[int], width: int, device: torch.device):
    """Row j of sequence s holds its query j (padding rows repeat its last one), at position
    seq_len - q_len + j: (offsets, flat-batch rows, positions), each `[S, width]`."""
    q_lens = [meta.query_lens_host[s] for s in seqs]
    offsets = torch.tensor([min(j, n - 1) for n in q_lens for j in range(width)], device=device).view(-1, width)
    index = torch.tensor(seqs, device=device)
    rows = meta.query_start[index].long()[:, None] + offsets
    positions = (meta.seq_lens[index].long() - torch.tensor(q_lens, device=device))[:, None] + offsets
    return offsets, rows, positions


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[S, W, Hq, D] -> [S, Hkv, G*W, D]: each KV head with the G query heads that read it."""
    s, w, hq, d = q.shape
    return q.view(s, w, num_kv_heads, hq // num_kv_heads, d).permute(0, 2, 3, 1, 4).reshape(s, num_kv_heads, -1, d)


def _ungrouped(x: torch.Tensor, width: int) -> torch.Tensor:
    """[S, Hkv, G*W, D] -> [S, W, Hq, D]."""
    s, hkv, gw, d = x.shape
    return x.view(s, hkv, gw // width, width, d).permute(0, 3, 1, 2, 4).reshape(s, width, -1, d)


def _attend(q, k, v, scale, mask):
    """Softmax attention that also returns the log-sum-exp of the scores, so partial results can merge."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint key sets from their outputs and log-sum-exps."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


class TorchOps:
    """Plain torch ops: the CPU path and the reference for the kernels."""

    graph_safe_decode = False  # its batched decode builds index tensors on the host

    def __init__(self) -> None:
        self._plan_for: AttentionMetadata | None = None  # the step the cached cascade plan belongs to
        self._plan_seqs: list[int] = []
        self._plan: CascadePlan | None = None

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if bool((slot_mapping < 0).any()):  # only padded batches skip rows: avoid masking the common case
            keep = slot_mapping >= 0
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def attention(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        lens = meta.query_lens_host
        decodes = [s for s, n in enumerate(lens) if n == 1]
        grouped = self._grouped_decodes(meta, decodes, k_cache.shape[1]) if len(decodes) > 1 else []
        in_groups = set(grouped)
        chunks = [s for s, n in enumerate(lens) if n <= SHORT_CHUNK and s not in in_groups]
        done: set[int] = set()
        if grouped:
            self._cascade(query, k_cache, v_cache, meta, scale, grouped, out)
            done.update(grouped)
        if len(chunks) > 1:
            self._padded_batch(query, k_cache, v_cache, meta, scale, chunks, out)
            done.update(chunks)
        for s in range(meta.num_seqs):
            if s not in done:
                self._one_sequence(query, k_cache, v_cache, meta, scale, s, out)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` cached tokens of one sequence: `[length, Hkv, D]`."""
        num_blocks = -(-length // cache.shape[1])
        return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:length]

    def _one_sequence(self, query, k_cache, v_cache, meta, scale, s, out) -> None:
        start, q_len, seq_len = int(meta.query_start[s]), meta.query_lens_host[s], meta.seq_lens_host[s]
        keys = self._gather(k_cache, meta.block_tables[s], seq_len).to(query.dtype)
        values = self._gather(v_cache, meta.block_tables[s], seq_len).to(query.dtype)
        # 4-D [1, H, L, D] inputs: with a batch dimension torch takes its fused CPU kernel, not the math path.
        q = query[start : start + q_len].transpose(0, 1)[None]
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if q_len == seq_len:  # nothing cached before the chunk: plain causal attention
            result = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # query j sits at position seq_len - q_len + j and sees keys 0..that position
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            result = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = result[0].transpose(0, 1)

    def _padded_batch(self, query, k_cache, v_cache, meta, scale, seqs, out) -> None:
        """Short chunks and ungrouped decodes in one padded SDPA call: one fused kernel, not one per sequence."""
        device, block = query.device, k_cache.shape[1]
        q_lens = [meta.query_lens_host[s] for s in seqs]
        width = max(q_lens)
        index = torch.tensor(seqs, device=device)
        num_blocks = -(-max(meta.seq_lens_host[s] for s in seqs) // block)
        tables = meta.block_tables[index, :num_blocks].long().flatten()
        span = num_blocks * block  # whole blocks: the mask hides what lies past each length
        keys = k_cache.index_select(0, tables).view(len(seqs), span, *k_cache.shape[2:]).to(query.dtype)
        values = v_cache.index_select(0, tables).view(len(seqs), span, *v_cache.shape[2:]).to(query.dtype)
        offsets, rows, positions = _padded_rows(meta, seqs, width, device)
        mask = torch.arange(span, device=device)[None, None, :] <= positions[:, :, None]
        result = F.scaled_dot_product_attention(
            query[rows].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None],
            scale=scale, enable_gqa=True,
        ).transpose(1, 2)  # [S, width, Hq, D]
        keep = offsets == torch.arange(width, device=device)[None, :]
        out[rows[keep]] = result[keep]

    def _cascade(self, query, k_cache, v_cache, meta, scale, seqs, out) -> None:
        """Decodes (and any short chunks) together, as cascade attention.

        Sequences of a prefix group point at the same physical blocks for their shared prefix, so the
        shared blocks are read once per group and attended by all the group's queries together; each
        sequence then attends to its own remaining blocks in one padded batch, and the two halves are
        merged by log-sum-exp. Without sharing, the second half alone is the whole attention.
        """
        device, block = query.device, k_cache.shape[1]
        plan = self._cascade_plan(meta, seqs, block)
        width = max(meta.query_lens_host[s] for s in seqs)
        offsets, rows, positions = _padded_rows(meta, seqs, width, device)
        q = _grouped(query[rows], k_cache.shape[2])  # [S, Hkv, G*W, D]

        own_blocks = torch.tensor(plan.own_blocks, device=device)  # [S, R] block ids after the shared part
        keys = k_cache.index_select(0, own_blocks.flatten()).view(*own_blocks.shape, block, *k_cache.shape[2:])
        values = v_cache.index_select(0, own_blocks.flatten()).view(*own_blocks.shape, block, *v_cache.shape[2:])
        keys, values = (x.flatten(1, 2).transpose(1, 2).to(query.dtype) for x in (keys, values))  # [S, Hkv, L, D]
        key_pos = torch.tensor(plan.first_own_block, device=device)[:, None] * block + torch.arange(
            keys.shape[2], device=device)[None, :]
        mask = (key_pos[:, None, :] <= positions[:, :, None]).repeat(1, q.shape[2] // width, 1)[:, None]
        result, lse = _attend(q, keys, values, scale, mask)

        for members, shared in plan.groups:  # the shared prefix: once per group, for all its queries
            blocks = torch.tensor(shared, device=device)
            k = k_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1).to(query.dtype)  # [Hkv, P, D]
            v = v_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1).to(query.dtype)
            picked = torch.tensor(members, device=device)
            group_q = q[picked].transpose(0, 1).flatten(1, 2)  # [Hkv, M*G*W, D]
            shared_out, shared_lse = _attend(group_q, k, v, scale, None)
            shape = (q.shape[1], len(members), q.shape[2])
            merged, merged_lse = _merge(
                result[picked], lse[picked], shared_out.view(*shape, -1).transpose(0, 1),
                shared_lse.view(shape).transpose(0, 1))
            result[picked], lse[picked] = merged, merged_lse
        result = _ungrouped(result, width)  # [S, W, Hq, D]
        keep = offsets == torch.arange(width, device=device)[None, :]
        out[rows[keep]] = result[keep].to(out.dtype)

    def _grouped_decodes(self, meta: AttentionMetadata, decodes: list[int], block: int) -> list[int]:
        """The decodes that share prefix blocks with another decode: cascade attention pays off for them."""
        plan = self._cascade_plan(meta, decodes, block)
        members = sorted(i for group, _ in plan.groups for i in group)
        if len(members) == len(decodes):
            return decodes
        return [decodes[i] for i in members] if len(members) > 1 else []

    def _cascade_plan(self, meta: AttentionMetadata, seqs: list[int], block: int) -> CascadePlan:
        """Which blocks each group shares: computed once per step, reused by every layer."""
        if self._plan_for is meta and self._plan_seqs == seqs:
            return self._plan
        tables = meta.block_tables.tolist()
        first_query_block = {s: (meta.seq_lens_host[s] - meta.query_lens_host[s]) // block for s in seqs}
        # A sequence's shared prefix: its leading blocks (wholly before its queries) that another sequence
        # of the batch holds too. Sequences with the same shared prefix form a group: in a prefix-ordered
        # batch that is the deepest level they share (a document under a system prompt), not just the first.
        holders = Counter(b for s in seqs for b in tables[s][: first_query_block[s]])
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(seqs):
            count = 0
            while count < first_query_block[s] and holders[tables[s][count]] > 1:
                count += 1
            if count:
                by_prefix.setdefault(tuple(tables[s][:count]), []).append(i)
        shared_count = [0] * len(seqs)
        groups = []
        for prefix, members in by_prefix.items():
            if len(members) < 2:
                continue
            for i in members:
                shared_count[i] = len(prefix)
            groups.append((members, list(prefix)))
        needed = [-(-meta.seq_lens_host[s] // block) - shared_count[i] for i, s in enumerate(seqs)]
        width = max(needed)
        own = [tables[s][shared_count[i] : shared_count[i] + needed[i]] + [0] * (width - needed[i])
               for i, s in enumerate(seqs)]
        self._plan_for, self._plan_seqs = meta, seqs
        self._plan = CascadePlan(own, shared_count, groups)
        return self._plan

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight.float()).to(x.dtype), x

    def rope(self, query, key, positions, cos_sin):
        table = cos_sin[positions]
        half = table.shape[-1] // 2
        cos, sin = table[:, None, :half], table[:, None, half:]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
