"""Random paged-attention batches, shared by the kernel tests and the GPU benchmark."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from batchprefill.intmath import cdiv
from batchprefill.kernels.fp8 import quantize_per_channel
from batchprefill.kernels.interface import AttentionMetadata, Ops
from batchprefill.model.config import ModelConfig
from batchprefill.model.decoder import DecoderModel

SPARE_BLOCKS = 3  # pool blocks no sequence owns, so a wrong table lookup reads foreign data


def random_paged_batch(
    specs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, k_cache, v_cache, meta) for sequences given as (cached context, new queries).

    Blocks are handed out in a random permutation, so tables are never in pool order; each table has one
    padded column past the longest sequence.
    """
    needed = [cdiv(context + q_len, block_size) for context, q_len in specs]
    num_blocks = sum(needed) + SPARE_BLOCKS
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    tables = torch.zeros(len(specs), max(needed) + 1, dtype=torch.int32)
    bounds = [0, *accumulate(needed)]
    slots = []
    for s, (context, q_len) in enumerate(specs):
        tables[s, : needed[s]] = order[bounds[s] : bounds[s + 1]]
        positions = torch.arange(context, context + q_len)
        slots.append(tables[s, positions // block_size].long() * block_size + positions % block_size)
    q_lens = [q_len for _, q_len in specs]
    seq_lens = [context + q_len for context, q_len in specs]
    meta = AttentionMetadata(
        query_start=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.cat(slots).to(device),
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    gen = torch.Generator(device).manual_seed(seed)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, generator=gen, dtype=dtype, device=device)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen, dtype=dtype, device=device)
    return query, k_cache, v_cache, meta


Sequence = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per position: query [n, Hq, D], key and value [n, Hkv, D]
Entry = tuple[int, int, int]  # (sequence, first position, count) of one step


def random_sequences(lengths: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: str | torch.device = "cpu", seed: int = 7) -> list[Sequence]:
    """Per-position queries, keys and values of sequences of these lengths, so that any split of a sequence into
    steps (`attention_of_entries`) sees the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(n, heads, head_dim, generator=gen).to(dtype).to(device)
              for heads in (num_q_heads, num_kv_heads, num_kv_heads))
        for n in lengths
    ]


def attention_of_entries(ops, seqs: list[Sequence], entries: list[Entry], block_size: int,
                         window: int | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """{(sequence, position): attention output [Hq, D]} of one step that computes, for each entry, the queries of
    its positions over a cache of every position up to them. Its blocks are spread over the pool in an order drawn
    from the step, so two different steps do not share a layout."""
    query0, key0, _ = seqs[0]
    device, dtype, kv_heads, head_dim = query0.device, query0.dtype, key0.shape[1], key0.shape[2]
    needed = [cdiv(start + count, block_size) for _, start, count in entries]
    order = torch.randperm(sum(needed) + SPARE_BLOCKS, generator=torch.Generator().manual_seed(sum(needed)))
    k_cache = torch.zeros(len(order), block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(entries), max(needed), dtype=torch.int32)
    queries, firsts = [], [0, *accumulate(needed)][:-1]
    for row, ((seq, start, count), blocks, first) in enumerate(zip(entries, needed, firsts, strict=True)):
        tables[row, :blocks] = order[first : first + blocks].to(torch.int32)
        positions = torch.arange(start + count)
        slots = (tables[row, positions // block_size].long() * block_size + positions % block_size).to(device)
        query, key, value = seqs[seq]
        k_cache.view(-1, kv_heads, head_dim)[slots] = key[: start + count]
        v_cache.view(-1, kv_heads, head_dim)[slots] = value[: start + count]
        queries.append(query[start : start + count])
    q_lens = [count for _, _, count in entries]
    seq_lens = [start + count for _, start, count in entries]
    meta = AttentionMetadata(
        query_start=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables.to(device),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    out = ops.attention(torch.cat(queries), k_cache, v_cache, meta, head_dim**-0.5, window)
    keys = [(seq, position) for seq, start, count in entries for position in range(start, start + count)]
    return dict(zip(keys, out, strict=True))


LAYER_SHAPES = {
    "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
    "self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64), "self_attn.v_proj.weight": (32, 64),
    "self_attn.o_proj.weight": (64, 64), "mlp.gate_proj.weight": (96, 64), "mlp.up_proj.weight": (96, 64),
    "mlp.down_proj.weight": (64, 96),
}


def tiny_llama(ops: Ops, num_layers: int = 1, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", fp8: bool = False) -> DecoderModel:
    """A random Llama of hidden size 64, 4 query heads over 2 KV heads of 16, a 50-token vocabulary; `fp8`: its
    layers' linears held in FP8 with one scale per channel, as a GPU with FP8 holds them."""
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_positions=128, tie_word_embeddings=False, qkv_bias=False, eos_token_ids=(0,),
    )
    gen = torch.Generator().manual_seed(7)
    shapes = {"model.embed_tokens.weight": (50, 64), "lm_head.weight": (50, 64), "model.norm.weight": (64,)}
    shapes |= {f"model.layers.{i}.{name}": shape for i in range(num_layers) for name, shape in LAYER_SHAPES.items()}
    weights = {name: (0.3 * torch.randn(shape, generator=gen)).to(dtype).to(device) for name, shape in shapes.items()}
    if fp8:
        weights = {name: quantize_per_channel(w) if "_proj" in name else w for name, w in weights.items()}
    return DecoderModel(config, weights, ops)


def unpadded_decode(model: DecoderModel, caches: list, ids: list[int], positions: np.ndarray, table: np.ndarray,
                    slots: np.ndarray) -> torch.Tensor:
    """The logits of one decode token per sequence through the model's plain forward: the reference a padded decode
    step (engine/decode_graphs.py) must match."""
    meta = AttentionMetadata(
        query_start=torch.arange(len(ids) + 1, dtype=torch.int32), seq_lens=torch.from_numpy(positions + 1).int(),
        block_tables=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots),
        query_lens_host=[1] * len(ids), seq_lens_host=(positions + 1).tolist(),
    )
    return model(torch.tensor(ids), torch.from_numpy(positions), caches, meta, torch.arange(len(ids)))
