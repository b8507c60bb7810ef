"""Random paged-attention batches, shared by the kernel tests and the GPU benchmark."""

from __future__ import annotations

from itertools import accumulate

import torch

from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata

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
