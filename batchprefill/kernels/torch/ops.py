"""`TorchOps`: the `Ops` interface in plain torch, the CPU path and the reference for the kernels.

On the CPU, a step's decodes go through shared-prefix decode attention, one C++ call per layer that reads the pool
in place (`kernels/native/paged_decode.py`; where it is not built, gathered copies and fused calls,
`decode_groups.py`): each group's shared blocks read once, then each decode's own. Prefill chunks join that call,
their rows walking the pool like decodes (a best-of-8 reward job's attention: 2.1x faster than the padded calls; a
512-token prompt's about 2x faster than torch's fused kernel; `_route_chunks` has the figures). Where the kernel is
not built, and beside the AMX tile walks, short chunks go through group attention (`prefix_groups.py`): a few fused
calls for the whole step; chunks too long for its dense mask run one fused call each.

With `batch_invariant` every query row, a chunk's as well as a decode's, goes through the C++ kernel instead
(`PagedDecode.plan_every_row`): a fused call's tiling follows its shapes, so a row's bits would depend on how its
prompt was chunked and what shared the call; the kernel's walks reduce each row's keys in one order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchprefill.intmath import cdiv
from batchprefill.kernels.experts import torch_experts
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.lora import torch_lora
from batchprefill.kernels.native import build as native_build
from batchprefill.kernels.native import elementwise as native_elementwise
from batchprefill.kernels.native import paged_decode
from batchprefill.kernels.native.paged_decode import PagedPlan
from batchprefill.kernels.shared_prefix import DecodeGroups
from batchprefill.kernels.torch import elementwise as torch_elementwise
from batchprefill.kernels.torch.decode_groups import DecodePlan, plan_decodes
from batchprefill.kernels.torch.prefix_groups import GroupBatch, batch_groups, find_groups, group_attention, pad_batch

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


def _route_chunks(meta: AttentionMetadata, block: int, paged: bool, tiles: bool
                  ) -> tuple[list[int], list[int], list[int]]:
    """A step's prefill chunks as (walked by the C++ kernel, grouped, alone).

    Where the kernel's vector walks run (`paged` and not `tiles`), every chunk walks: its rows in runs that read
    the blocks before them once (`paged_decode._chunk_sets`), each row's online softmax in float32. Against the fused
    calls they replace, 2 threads, 16-token blocks, AMD EPYC Zen 4 (`benchmarks/cpu/chunk_routes.py`), SmolLM2's heads
    (9 of 64 over 3) in float32, bfloat16, and bfloat16 over an FP8 pool: a 512-token prompt 0.62, 0.53 and 0.37x
    the time; 384 tokens after 64 cached 0.48, 0.56 and 0.38x; 2,048 from scratch 0.75, 0.84 and 0.54x; Llama-3-8B's
    heads (32 of 128 over 8; runs of 192 rows) 0.31-0.82x in float32 and 0.23-0.59x over FP8 (at 512 tokens
    torch's kernel 70-74 GFLOP/s, the walks 136-160). Short prompts from scratch over a bfloat16 pool gain least
    (eight of 64 tokens: 0.94x), as that pool's walks widen every key to float32 where the fused call takes bfloat16.
    In whole jobs the `shared` workload's engine loop took 0.79x the time in bfloat16 over FP8 and 0.90x in float32,
    decode128's 0.93x (`benchmarks/cpu/revisions.py`).

    The AMX tile walks (`tiles`) keep the old routes, unmeasured against them: short chunks after a whole cached
    block walk, other short chunks go to group attention, long ones run alone in torch's fused kernel, which takes
    bfloat16 on the tiles there (163-257 GFLOP/s on one Xeon core). Without the kernel, the last two routes take
    every chunk."""
    lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    chunks = [s for s, n in enumerate(lens) if n > 1]
    if paged and not tiles:
        return chunks, [], []
    short = [s for s in chunks if lens[s] * seq_lens[s] <= GROUPED_MAX_PAIRS]
    alone = [s for s in chunks if lens[s] * seq_lens[s] > GROUPED_MAX_PAIRS]
    # short chunks after a whole cached block: the kernel's walks (PagedDecode.plan); the rest, group attention
    after_cached = [paged and seq_lens[s] - lens[s] >= block for s in short]
    return ([s for s, walks in zip(short, after_cached) if walks],
            [s for s, walks in zip(short, after_cached) if not walks], alone)


@dataclass(frozen=True)
class TorchPlan:
    """A step's attention layout on the torch path: its decodes, its batches of grouped short chunks, and the
    chunks that run alone."""

    decodes: PagedPlan | DecodePlan | None  # either attends with `.attend(query, k, v, scale, out)`; with
    # batch invariance, a PagedPlan of every row
    batches: list[GroupBatch]
    alone: list[int]  # chunks too long for group attention
    # batch-invariant steps: window -> every row's plan under it, built at the first layer that has that window
    windowed: Callable[[int], PagedPlan | None] | None = None


class TorchOps:
    """Plain torch ops: the CPU path and the reference for the kernels."""

    graph_safe_decode = False  # its batched decode builds index tensors on the host

    def __init__(self, native: bool = True, batch_invariant: bool = False):
        """`native`: decodes read the pool in place through the C++ kernel where it builds
        (`kernels/native/paged_decode.py`); otherwise, where it cannot be built, and for KV dtypes it lacks, each
        decode's blocks are gathered."""
        self.batch_invariant = batch_invariant
        self._paged = paged_decode.load() if native else None
        if batch_invariant and self._paged is None:
            raise ValueError("engine.batch_invariant=true runs its attention in the CPU path's C++ kernel, which is "
                             f"not built here: install a C++ compiler (g++) and leave {native_build.DISABLE_VARIABLE} "
                             "unset")
        elementwise = native_elementwise.load() if native else None  # per-token ops in one pass per row
        plain = elementwise is None
        self.rms_norm = torch_elementwise.rms_norm if plain else elementwise.rms_norm
        self.rope = torch_elementwise.rope if plain else elementwise.rope
        self.store_kv = torch_elementwise.store_kv if plain else elementwise.store_kv
        self.gated_activation = torch_elementwise.gated_activation if plain else elementwise.gated_activation

    def group_decodes(self, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int, heads_per_kv: int
                      ) -> DecodeGroups | None:
        """None: this backend groups a step's decodes in `plan`, from the step's own tables."""
        return None

    def plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int, dtype: torch.dtype
             ) -> AttentionMetadata:
        """Group the step's sequences once for all layers: decodes by the prefix they share, with the chunks
        `_route_chunks` walks (kernels/native/paged_decode.py; decodes through decode_groups.py where the kernel is
        not built or lacks the KV dtype), the short chunks it groups into padded group batches (prefix_groups.py),
        the long ones alone."""
        block, per_kv = k_cache.shape[1], num_q_heads // k_cache.shape[2]
        lens, tables = meta.query_lens_host, meta.block_tables.tolist()
        # the C++ kernel walks host memory: on a GPU this backend is the reference, all torch ops on the device
        paged = self._paged is not None and k_cache.device.type == "cpu" and self._paged.supports(k_cache.dtype)
        tiles = paged and dtype == k_cache.dtype == torch.bfloat16 and self._paged.uses_tiles(block, k_cache.shape[3])
        if self.batch_invariant:  # every row through the kernel's one walk: a fused call's tiling follows its shape
            if k_cache.device.type != "cpu":
                raise ValueError("engine.batch_invariant=true with engine.attention_backend=torch runs on the CPU only")
            every_row = self._paged.plan_every_row(meta, tables, block, per_kv, tiles)
            windowed = functools.cache(functools.partial(self._paged.plan_windowed, meta, tables, block))
            return meta.with_plan(TorchPlan(every_row, [], [], windowed))
        decodes = [s for s, n in enumerate(lens) if n == 1]
        walked, grouped, alone = _route_chunks(meta, block, paged, tiles)
        batches = [pad_batch(batch, meta, block, per_kv, dtype, k_cache.device)
                   for batch in batch_groups(find_groups(meta, grouped, tables, block), meta)]
        if paged:
            decode_plan = self._paged.plan(meta, decodes, walked, tables, block, per_kv, tiles)
        else:
            decode_plan = plan_decodes(meta, decodes, tables, block, dtype, k_cache.device)
        return meta.with_plan(TorchPlan(decode_plan, batches, alone))

    def attention(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  window: int | None = None) -> torch.Tensor:
        """A few fused calls for the whole step: decodes, then batches of short chunks; chunks too long for a
        dense mask run one fused call each. A sliding window that hides keys this step runs each sequence
        alone over the keys its window holds (the group plans assume full attention); under batch invariance, each
        row alone through the kernel (`PagedDecode.plan_windowed`)."""
        if window is not None and not self.batch_invariant and window < max(meta.seq_lens_host, default=0):
            out = torch.empty_like(query)
            for s in range(meta.num_seqs):
                self._one_windowed(query, k_cache, v_cache, meta, scale, s, out, window)
            return out
        if meta.plan is None:  # a caller outside the model (a test, a benchmark) planned nothing
            meta = self.plan(meta, k_cache, query.shape[1], query.dtype)
        out = torch.empty_like(query)
        if window is not None and self.batch_invariant:
            every_row = meta.plan.windowed(window)
            if every_row is not None:
                every_row.attend(query, k_cache, v_cache, scale, out)
            return out
        if meta.plan.decodes is not None:
            meta.plan.decodes.attend(query, k_cache, v_cache, scale, out)
        for batch in meta.plan.batches:
            group_attention(query, k_cache, v_cache, scale, batch, out)
        for s in meta.plan.alone:
            self._one_sequence(query, k_cache, v_cache, meta, scale, s, out)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = 0) -> torch.Tensor:
        """One sequence's cached tokens from block `first_block` up to position `length`: `[tokens, Hkv, D]`."""
        size = cache.shape[1]
        blocks = cache.index_select(0, block_table[first_block : cdiv(length, size)].long()).flatten(0, 1)
        return blocks[: length - first_block * size]

    def _one_windowed(self, query, k_cache, v_cache, meta, scale, s, out, window: int) -> None:
        """One sequence under a sliding window: the query at position p sees keys p - window + 1 .. p, and
        blocks wholly left of every query's window are not even read."""
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

    def _one_sequence(self, query, k_cache, v_cache, meta, scale, s, out) -> None:
        start, q_len, seq_len = int(meta.query_start[s]), meta.query_lens_host[s], meta.seq_lens_host[s]
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

    def moe(self, hidden, experts, topk_weights, topk_ids):
        return torch_experts(hidden, experts, topk_weights, topk_ids)

    def lora(self, out, x, weights, step):
        torch_lora(out, x, weights, step, self.batch_invariant)

