"""Every Triton kernel against the torch reference, under Triton's CPU interpreter.

TRITON_INTERPRET=1 comes from tests/conftest.py. Shapes stay small: the interpreter costs about 15 ms per
program and tile iteration, whatever the tile size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchprefill.engine.decode_graphs import PaddedDecode
from batchprefill.kernels.torch import elementwise as torch_elementwise
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton.attention import _decode_kernel, _merge_kernel, _prefill_kernel
from batchprefill.kernels.triton.ops import TritonOps, prefill_warps_and_stages
from batchprefill.model.rope import rope_cos_sin
from tests.synthetic import random_paged_batch, tiny_llama, unpadded_decode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # bf16: interpreter casts truncate


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh float buffers start as NaN, so a row a kernel forgot to write fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.float16], ids=["same", "fp16-cache"])
def test_store_kv(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, heads, head_dim, num_blocks, block_size = 11, 3, 48, 5, 4
    key = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    shape = (num_blocks, block_size, heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=cache_dtype or dtype) for _ in range(4)]
    TritonOps().store_kv(key, value, caches[0], caches[1], slots)
    TorchOps().store_kv(key, value, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
        assert (~got.isnan()).all(-1).all(-1).sum() == tokens - 2  # skipped slots left untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(2, 3, hidden, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(2, 3, hidden, generator=gen).to(dtype) if with_residual else None
    got, got_residual = TritonOps().rms_norm(x, weight, 1e-6, residual)
    want, want_residual = TorchOps().rms_norm(x, weight, 1e-6, residual)
    assert_close(got, want, dtype)
    assert_close(got_residual, want_residual, dtype)
    if not with_residual:
        assert got_residual is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 48, 64])
def test_rope(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    tokens, q_heads, kv_heads = 7, 6, 2
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query, key = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads]  # strided views, as the model makes
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    cos_sin = rope_cos_sin(head_dim, 300, 10000.0)
    got_q, got_k = TritonOps().rope(query, key, positions, cos_sin)
    want_q, want_k = TorchOps().rope(query, key, positions, cos_sin)
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_activation(dtype: torch.dtype, activation: str) -> None:
    # 1,100 columns: one full 1,024-column program per row and a ragged one; gates out to +-12, where the tanh
    # and the sigmoid saturate
    gen = torch.Generator().manual_seed(len(activation))
    gate_up = (4 * torch.randn(5, 2 * 1100, generator=gen)).to(dtype)
    got = TritonOps().gated_activation(gate_up, activation)
    want = torch_elementwise.gated_activation(gate_up, activation)
    assert got.shape == (5, 1100)
    assert_close(got, want, dtype)


# (sequences as (context, queries), q heads, kv heads, head dim, block size, TritonOps settings)
ATTENTION_CASES = {
    # 100 cached + 37 new: two 32-row tiles, the last one ragged; context ends mid-block
    "ragged-chunk": ([(100, 37)], 6, 2, 64, 16, dict(block_m=32, block_n=32)),
    # prefill chunks and decodes in one launch; 64-token KV tiles span four 16-token blocks
    "mixed-batch": ([(40, 50), (0, 64), (77, 1), (130, 1)], 6, 2, 32, 16, dict(block_m=32, block_n=64)),
    # 16-token KV tiles inside 64-token blocks; no GQA; head dim padded to 64
    "small-tiles": ([(78, 20), (5, 3)], 4, 4, 48, 64, dict(block_m=16, block_n=16)),
    "default-tiles": ([(0, 64), (150, 1)], 3, 1, 64, 16, dict()),
    # decode only, split into 64-token segments of two 32-token tiles and merged
    "decode-split": ([(255, 1), (90, 1), (3, 1)], 6, 2, 64, 16,
                     dict(block_n=32, decode_min_segment=64, decode_target_programs=64)),
    "decode-single-segment": ([(200, 1), (17, 1)], 6, 2, 64, 32, dict(block_n=32, decode_target_programs=1)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(dtype: torch.dtype, case: str) -> None:
    specs, q_heads, kv_heads, head_dim, block_size, settings = ATTENTION_CASES[case]
    query, k_cache, v_cache, meta = random_paged_batch(
        specs, q_heads, kv_heads, head_dim, block_size, dtype, seed=list(ATTENTION_CASES).index(case)
    )
    ops = TritonOps(**settings)
    if case == "decode-split":
        assert ops.decode_segments(meta, kv_heads) == 4
    got = ops.attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    want = TorchOps().attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(got, want, dtype)


def test_a_decode_grid_planned_for_4096_tokens_splits_contexts_of_121_10_and_301_on_the_device() -> None:
    """Host lengths only size the grid: a launch planned for longer contexts (as a captured CUDA graph is)
    reads the true lengths from the device and splits each context there (301 tokens: 10 segments of 32
    within the grid's 11; 10 tokens: one)."""
    query, k_cache, v_cache, meta = random_paged_batch([(120, 1), (9, 1), (300, 1)], 4, 2, 32, 16, torch.float32)
    want = TorchOps().attention(query, k_cache, v_cache, meta, 0.2)
    meta.seq_lens_host = [4096] * 3
    ops = TritonOps(block_n=16, decode_min_segment=16, decode_target_programs=64)
    assert ops.decode_segments(meta, 2) == 11
    assert_close(ops.attention(query, k_cache, v_cache, meta, 0.2), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_150_and_130_queries_fill_four_128_row_tiles(dtype: torch.dtype) -> None:
    """The tile every long chunk uses on a GPU (the interpreter's default is 64 rows), here with head dim 80
    padded to 128 and a decode beside the chunks."""
    query, k_cache, v_cache, meta = random_paged_batch([(60, 150), (0, 130), (90, 1)], 4, 2, 80, 16, dtype, seed=5)
    ops = TritonOps(block_m=128)
    got = ops.attention(query, k_cache, v_cache, meta, 80**-0.5)
    assert ops.plan(meta, k_cache, query.shape[1], dtype).plan.tile_map.shape == (4, 2)
    assert_close(got, TorchOps().attention(query, k_cache, v_cache, meta, 80**-0.5), dtype)


def test_a_mixed_step_of_two_chunks_and_three_decodes_tiles_only_the_chunks() -> None:
    """Single-token rows of a mixed step go to the decode kernel: 50 and 64 queries make 2 + 2 tiles of 32
    rows, the three decodes are served by index (sequences 2, 3, 4), and every row is written."""
    specs = [(40, 50), (0, 64), (77, 1), (130, 1), (5, 1)]
    query, k_cache, v_cache, meta = random_paged_batch(specs, 6, 2, 32, 16, torch.float32, seed=3)
    ops = TritonOps(block_m=32, decode_min_segment=32)
    got = ops.attention(query, k_cache, v_cache, meta, 0.25)
    plan = ops.plan(meta, k_cache, query.shape[1], torch.float32).plan
    assert plan.tile_map.shape == (4, 2) and set(plan.tile_map[:, 0].tolist()) == {0, 1}
    assert plan.decode_rows.tolist() == [2, 3, 4]
    assert plan.decode_rows.data_ptr() % 16 == 0  # its alignment does not depend on the tile count
    assert_close(got, TorchOps().attention(query, k_cache, v_cache, meta, 0.25), torch.float32)


def test_head_dim_96_pads_to_128_so_128_row_tiles_take_eight_warps() -> None:
    assert prefill_warps_and_stages(128, 96) == (8, 3)
    assert prefill_warps_and_stages(128, 80) == (8, 3)
    assert prefill_warps_and_stages(64, 96) == (4, 3)
    assert prefill_warps_and_stages(64, 192) == (8, 2)
    assert prefill_warps_and_stages(64, 128, narrow=True) == (4, 2)  # a small shared memory: two stages


def test_arguments_that_change_every_step_are_not_specialized() -> None:
    """The block table's width and the decode split vary per step: a specialization on them would compile
    new kernel variants in the middle of a run."""
    for kernel, names in ((_prefill_kernel, {"stride_table"}), (_decode_kernel, {"stride_table", "min_segment"}),
                          (_merge_kernel, {"min_segment", "num_segments"})):
        declared = kernel.kwargs if hasattr(kernel, "kwargs") else vars(kernel)  # interpreter or compiler
        assert names <= set(declared["do_not_specialize"])
        assert names <= set(declared["do_not_specialize_on_alignment"])


def test_padded_decode_of_3_then_2_rows_matches_the_unpadded_forward_despite_stale_buffers() -> None:
    """The fixed buffers a CUDA graph replays: a batch of 3 padded to 4 with 5-block tables, then a batch
    of 2 with 2-block tables over the first step's leftovers, each against the plain forward."""
    device = torch.device("cpu")
    model = tiny_llama(TritonOps())
    gen = torch.Generator().manual_seed(8)
    caches = [(torch.randn(12, 8, 2, 16, generator=gen), torch.randn(12, 8, 2, 16, generator=gen))]
    decoder = PaddedDecode(model, caches, block_size=8, max_num_seqs=4, device=device, capture=False)
    steps = [([3, 9, 4], [37, 5, 20], [[7, 1, 2, 9, 4], [3, 0, 0, 0, 0], [5, 6, 8, 0, 0]]),
             ([11, 2], [12, 3], [[10, 11], [0, 0]])]
    for ids, positions, tables in steps:
        table = np.asarray(tables, dtype=np.int32)
        pos = np.asarray(positions)
        slots = table[np.arange(len(ids)), pos // 8].astype(np.int64) * 8 + pos % 8
        got = decoder.run(np.asarray(ids), pos, slots, pos + 1, table)
        want = unpadded_decode(model, caches, ids, pos, table, slots)
        assert_close(got, want, torch.float32)


def test_one_ops_object_across_steps() -> None:
    """The tile map is cached per step shape: a new batch on the same object must not reuse a stale one."""
    ops = TritonOps(block_m=16, block_n=16)
    for seed, specs in enumerate([[(30, 40)], [(0, 9), (50, 20)], [(30, 40)]]):
        query, k_cache, v_cache, meta = random_paged_batch(specs, 2, 1, 32, 16, torch.float32, seed=seed)
        want = TorchOps().attention(query, k_cache, v_cache, meta, 0.3)
        assert_close(ops.attention(query, k_cache, v_cache, meta, 0.3), want, torch.float32)


@pytest.mark.parametrize("specs", [[(60, 30)], [(60, 1), (7, 1)]], ids=["prefill", "decode"])
def test_cache_dtype_differs_from_query(specs: list[tuple[int, int]]) -> None:
    query, k_cache, v_cache, meta = random_paged_batch(specs, 4, 2, 32, 16, torch.float32)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    want = TorchOps().attention(query, k_cache, v_cache, meta, 0.2)
    assert_close(TritonOps().attention(query, k_cache, v_cache, meta, 0.2), want, torch.float32)


def test_fp32_dots_run_as_tf32_only_when_torch_allows_it_else_exact_on_32_token_tiles(monkeypatch) -> None:
    """What a GPU would launch (the interpreter always runs exact fp32 dots): torch's default 'highest'
    keeps fp32 exact on half-width KV tiles and warns once; 'high' turns on TF32; bf16 is unaffected. Tiles narrowed
    for a small shared memory (`_narrow`) are half-width whatever the dots."""
    from batchprefill.kernels.triton import attention as triton_attention
    from batchprefill.kernels.triton import ops as triton_ops

    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)
    monkeypatch.setattr(triton_ops, "interpreting", lambda: False)
    monkeypatch.setattr(triton_attention, "_warned_exact_fp32", [])
    previous = torch.get_float32_matmul_precision()
    try:
        with pytest.warns(UserWarning, match="exact"):
            assert triton_attention.dot_settings(torch.float32) == (False, "ieee")
        assert TritonOps()._block_n(torch.float32, narrow=False) == 32
        assert TritonOps()._block_n(torch.bfloat16, narrow=False) == 64
        torch.set_float32_matmul_precision("high")
        assert triton_attention.dot_settings(torch.float32) == (False, "tf32")
        assert TritonOps()._block_n(torch.float32, narrow=False) == 64
        assert TritonOps()._block_n(torch.float32, narrow=True) == TritonOps()._block_n(torch.bfloat16, True) == 32
    finally:
        torch.set_float32_matmul_precision(previous)
