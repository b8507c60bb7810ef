"""Sliding-window attention: the torch path against a dense reference, the Triton kernels against torch.

A query at position p sees keys p - window + 1 .. p (transformers' `kv_idx > q_idx - sliding_window`).
Triton runs under the interpreter (tests/conftest.py), so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton.ops import TritonOps
from tests.synthetic import random_paged_batch


def dense_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None) -> torch.Tensor:
    """Softmax attention per sequence with the full score matrix and an explicit mask, in float64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        start = int(meta.query_start[s])
        slots = [int(meta.block_tables[s, p // block]) * block + p % block for p in range(seq_len)]
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)  # [L, Hq, D]
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        q = query[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


# (sequences as (context, queries), window, block size): windows smaller and larger than chunks and contexts
TORCH_CASES = {
    "decodes-past-the-window": ([(40, 1), (9, 1), (3, 1)], 8, 4),
    "chunks-smaller-than-the-window": ([(30, 5), (0, 6)], 8, 4),
    "chunk-larger-than-the-window": ([(12, 24), (0, 30)], 8, 4),
    "window-longer-than-every-sequence": ([(10, 5), (20, 1)], 64, 16),
    "long-chunk-alone": ([(200, 400)], 37, 16),  # 240k query-key pairs: past group attention, one fused call
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_torch_attention_under_a_window_matches_a_dense_reference(case: str) -> None:
    specs, window, block = TORCH_CASES[case]
    query, k_cache, v_cache, meta = random_paged_batch(specs, 4, 2, 16, block, torch.float32, seed=3)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 0.25, window)
    want = dense_reference(query, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    unwindowed = dense_reference(query, k_cache, v_cache, meta, 0.25, None)
    if case == "window-longer-than-every-sequence":
        torch.testing.assert_close(got.double(), unwindowed, atol=1e-5, rtol=1e-5)
    else:  # the window changed the result: the test would catch a path that ignores it
        assert (got.double() - unwindowed).abs().max() > 1e-2


def test_decodes_sharing_a_prefix_see_only_their_window_of_it() -> None:
    """Two decodes over the same 6 physical blocks (a group for the full-attention layers); with a window of 5
    each query must not see the shared blocks it has left behind, and the step's plan still serves the
    full-attention layers."""
    query, k_cache, v_cache, meta = random_paged_batch([(27, 1), (29, 1)], 4, 2, 16, 4, torch.float32, seed=5)
    meta.block_tables[1, :6] = meta.block_tables[0, :6]  # the first 24 positions share blocks
    ops = TorchOps()
    meta = ops.plan(meta, k_cache, query.shape[1], query.dtype)
    got = ops.attention(query, k_cache, v_cache, meta, 0.25, 5)
    torch.testing.assert_close(got.double(), dense_reference(query, k_cache, v_cache, meta, 0.25, 5),
                               atol=1e-5, rtol=1e-5)
    full = ops.attention(query, k_cache, v_cache, meta, 0.25)  # same step, another layer: no window
    torch.testing.assert_close(full.double(), dense_reference(query, k_cache, v_cache, meta, 0.25, None),
                               atol=1e-5, rtol=1e-5)


# (sequences, q heads, kv heads, head dim, block size, window, TritonOps settings)
TRITON_CASES = {
    # 100 cached + 37 new under a 24-token window: tiles start at the window, not at 0
    "ragged-chunk": ([(100, 37)], 4, 2, 32, 16, 24, dict(block_m=32, block_n=32)),
    # chunks smaller and larger than the window and decodes in one launch
    "mixed-batch": ([(40, 5), (0, 40), (77, 1)], 4, 2, 32, 8, 16, dict(block_m=16, block_n=16)),
    # decode split into 32-token segments: those wholly before the window stay empty in the merge
    "decode-split": ([(150, 1), (20, 1)], 4, 2, 32, 16, 40,
                     dict(block_n=16, decode_min_segment=32, decode_target_programs=64)),
    "decode-single-segment": ([(90, 1), (5, 1)], 4, 1, 32, 16, 12, dict(block_n=16, decode_target_programs=1)),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_attention_under_a_window_matches_torch(case: str) -> None:
    specs, q_heads, kv_heads, head_dim, block_size, window, settings = TRITON_CASES[case]
    query, k_cache, v_cache, meta = random_paged_batch(specs, q_heads, kv_heads, head_dim, block_size,
                                                       torch.float32, seed=7)
    ops = TritonOps(**settings)
    if case == "decode-split":
        assert ops.decode_segments(meta, kv_heads) == 5
    got = ops.attention(query, k_cache, v_cache, meta, head_dim**-0.5, window)
    want = TorchOps().attention(query, k_cache, v_cache, meta, head_dim**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    unwindowed = TorchOps().attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    assert (got - unwindowed).abs().max() > 1e-2
