"""The ops the model calls, their metadata, and the plain torch implementation.

Every backend implements the same functions with the same tensor layouts, so the model never
knows which one runs. The torch path is both the CPU path and the reference the Triton kernels are
tested against.

Layouts:
- flat batch: all query tokens of a step in one dimension `T` (prefill chunks and decodes mixed);
- KV cache of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, one tensor for K, one for V;
- a token's cache slot is `block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from batchprefill.kernels.experts import ExpertWeights, torch_experts
from batchprefill.kernels.prefix_groups import Group, GroupBatch, batch_groups, find_groups, group_attention, lay_out


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
        scale: float, window: int | None = None,
    ) -> torch.Tensor:
        """Causal paged attention for a flat batch: query `[T, Hq, D]` -> `[T, Hq, D]`.

        Query j of sequence s sits at absolute position `p = seq_len - query_len + j` and attends to every
        cached position up to and including its own; with a sliding `window`, only to positions above
        `p - window`. Hq is a multiple of Hkv (GQA).
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

    def moe(
        self, hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Mixture-of-experts MLP `[T, H]` -> `[T, H]`: each token's `topk_ids` `[T, K]` experts, weighted by
        `topk_weights` `[T, K]` (float32) and summed."""


ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The `[max_positions, head_dim]` cos|sin table for rotate-half RoPE, in float32.

    `head_dim` is the rotated width (less than the head under partial rotary). Longrope's table takes its
    short factors below `original_max_position_embeddings` and its long ones from there on: per position,
    so a block's KV never depends on how long its sequence grows (transformers picks one set for the whole
    sequence by its length; the two agree on every sequence within the original context).
    """
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(max_positions, dtype=torch.float64)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "longrope":
        return _longrope_table(exponents, positions, theta, scaling, max_positions)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _longrope_table(exponents: torch.Tensor, positions: torch.Tensor, theta: float, scaling: dict,
                    max_positions: int) -> torch.Tensor:
    """Phi-3's longrope: per-frequency stretch factors (short or long) and an attention factor on cos and sin."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    tables = []
    for ext in (scaling["short_factor"], scaling["long_factor"]):
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float64) * theta**exponents)
        angles = torch.outer(positions, inv_freq)
        tables.append(torch.cat([angles.cos(), angles.sin()], dim=-1) * attention)
    short, long = tables
    return torch.where((positions < original)[:, None], short, long).float()


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


# Chunks with at most this many query-key pairs go through group attention: at that size a fused call is
# mostly fixed overhead, so batching pays. Longer chunks are real work and run alone, where the kernel can
# skip what a causal chunk does not see (a dense mask costs 4 bytes per pair and head group, and is scanned).
GROUPED_MAX_PAIRS = 1 << 16


# A chunk with this many queries or more, after a cached prefix, attends to the prefix and to itself in two
# fused calls merged by log-sum-exp: the causal half then skips what its queries cannot see, where one call
# under a mask computes the whole square (1.2-1.5x at 768-2048 queries; below that, no gain).
SPLIT_CAUSAL_QUERIES = 768


def _cached_then_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int,
                        scale: float) -> torch.Tensor:
    """Attention of a chunk `[1, Hq, Q, D]` over `cached` earlier keys and itself (causal), on the CPU."""
    repeat = q.shape[1] // keys.shape[1]  # the fused CPU kernel wants as many KV heads as query heads
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    prefix_out, prefix_lse = flash(q, keys[:, :, :cached], values[:, :, :cached], 0.0, False, scale=scale)
    chunk_out, chunk_lse = flash(q, keys[:, :, cached:], values[:, :, cached:], 0.0, True, scale=scale)
    lse = torch.logaddexp(prefix_lse, chunk_lse)
    return prefix_out * torch.exp(prefix_lse - lse)[..., None] + chunk_out * torch.exp(chunk_lse - lse)[..., None]


class TorchOps:
    """Plain torch ops: the CPU path and the reference for the kernels."""

    graph_safe_decode = False  # its batched decode builds index tensors on the host

    def __init__(self) -> None:
        self._batches_for: AttentionMetadata | None = None  # the step the cached group batches belong to
        self._groups: list[list[Group]] = []
        self._batches: dict[int | None, list[GroupBatch]] = {}  # by window: each masks its own keys
        self._alone: list[int] = []  # the step's chunks too long for group attention
        self._rope_for: torch.Tensor | None = None  # the positions the cached cos/sin rows belong to
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id of the table (one per RoPE base)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if bool((slot_mapping < 0).any()):  # only padded batches skip rows: avoid masking the common case
            keep = slot_mapping >= 0
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def attention(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  window: int | None = None) -> torch.Tensor:
        """Decodes and chunks go through shared-prefix group attention, a few fused calls for the whole
        step; chunks too long for its dense mask run one fused call each."""
        out = torch.empty_like(query)
        for batch in self._group_batches(meta, query, k_cache, window):
            group_attention(query, k_cache, v_cache, scale, batch, out)
        for s in self._alone:
            self._one_sequence(query, k_cache, v_cache, meta, scale, s, out, window)
        return out

    def _group_batches(self, meta: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor,
                       window: int | None) -> list[GroupBatch]:
        """The step's group batches: grouped on the first layer, laid out once per window, reused by the
        other layers.

        Decodes and chunks are grouped apart, so a decode is never padded to a chunk's width; `_alone`
        gets the chunks too long to group.
        """
        block, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        if self._batches_for is not meta:
            lens, tables = meta.query_lens_host, meta.block_tables.tolist()
            decodes = [s for s, n in enumerate(lens) if n == 1]
            pairs = [n * seq_len for n, seq_len in zip(lens, meta.seq_lens_host)]
            chunks = [s for s, n in enumerate(lens) if n > 1 and pairs[s] <= GROUPED_MAX_PAIRS]
            self._alone = [s for s, n in enumerate(lens) if n > 1 and pairs[s] > GROUPED_MAX_PAIRS]
            self._groups = [batch for seqs in (decodes, chunks)
                            for batch in batch_groups(find_groups(meta, seqs, tables, block), meta)]
            self._batches = {}
            self._batches_for = meta
        if window not in self._batches:
            self._batches[window] = [lay_out(batch, meta, block, query.shape[1] // num_kv_heads, query.dtype,
                                             query.device, window) for batch in self._groups]
        return self._batches[window]

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = 0) -> torch.Tensor:
        """One sequence's cached tokens from block `first_block` up to position `length`: `[tokens, Hkv, D]`."""
        size = cache.shape[1]
        num_blocks = -(-length // size)
        blocks = cache.index_select(0, block_table[first_block:num_blocks].long()).flatten(0, 1)
        return blocks[: length - first_block * size]

    def _one_sequence(self, query, k_cache, v_cache, meta, scale, s, out, window: int | None = None) -> None:
        start, q_len, seq_len = int(meta.query_start[s]), meta.query_lens_host[s], meta.seq_lens_host[s]
        if window is not None and seq_len > window:  # keys left of every query's window are not even read
            self._one_windowed(query, k_cache, v_cache, meta, scale, s, out, window)
            return
        keys = self._gather(k_cache, meta.block_tables[s], seq_len).to(query.dtype)
        values = self._gather(v_cache, meta.block_tables[s], seq_len).to(query.dtype)
        # 4-D [1, H, L, D] inputs: with a batch dimension torch takes its fused CPU kernel, not the math path.
        q = query[start : start + q_len].transpose(0, 1)[None]
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if q_len == seq_len:  # nothing cached before the chunk: plain causal attention
            result = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        elif q_len >= SPLIT_CAUSAL_QUERIES and q.device.type == "cpu":
            result = _cached_then_causal(q, keys, values, seq_len - q_len, scale)
        else:  # query j sits at position seq_len - q_len + j and sees keys 0..that position
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            result = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = result[0].transpose(0, 1)

    def _one_windowed(self, query, k_cache, v_cache, meta, scale, s, out, window: int) -> None:
        """One chunk under a sliding window: query at position p sees keys p - window + 1 .. p."""
        start, q_len, seq_len = int(meta.query_start[s]), meta.query_lens_host[s], meta.seq_lens_host[s]
        first_block = max(0, seq_len - q_len - window + 1) // k_cache.shape[1]
        keys = self._gather(k_cache, meta.block_tables[s], seq_len, first_block).to(query.dtype)
        values = self._gather(v_cache, meta.block_tables[s], seq_len, first_block).to(query.dtype)
        key_pos = torch.arange(first_block * k_cache.shape[1], seq_len, device=query.device)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        offset = query_pos[:, None] - key_pos[None, :]
        mask = (offset >= 0) & (offset < window)
        q = query[start : start + q_len].transpose(0, 1)[None]
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        result = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = result[0].transpose(0, 1)

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        x32 = x.float()
        inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        return (x32 * inverse_rms).mul_(weight).to(x.dtype), x

    def rope(self, query, key, positions, cos_sin):
        if self._rope_for is not positions:  # every layer of a step rotates by the same positions
            self._rope_for, self._rope = positions, {}
        if id(cos_sin) not in self._rope:
            table = cos_sin[positions]
            half = table.shape[-1] // 2
            cos, sin = table[:, None, :half], table[:, None, half:]
            self._rope[id(cos_sin)] = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
        rows = self._rope[id(cos_sin)]
        return _rotate(query, *rows), _rotate(key, *rows)

    def moe(self, hidden, experts, topk_weights, topk_ids):
        return torch_experts(hidden, experts, topk_weights, topk_ids)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in three ops: x * cos + (x2, x1) * (-sin, sin)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    swapped = torch.cat([x32[..., half:], x32[..., :half]], dim=-1)
    return torch.addcmul(x32 * cos, swapped, signed_sin).to(x.dtype)
