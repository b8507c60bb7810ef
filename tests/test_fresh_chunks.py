"""Chunks with nothing cached before them, routed around the Triton prefill kernel (kernels/triton/fresh_chunks.py),
against the torch reference under Triton's CPU interpreter (on the CPU they run one causal SDPA each)."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton import attention as triton_attention
from batchprefill.kernels.triton import fresh_chunks
from batchprefill.kernels.triton import ops as triton_ops
from batchprefill.kernels.triton.fresh_chunks import fresh_layout
from batchprefill.kernels.triton.ops import TritonOps
from tests.synthetic import random_paged_batch, tiny_llama

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 16  # GQA 3:1


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh float buffers start as NaN, so a row nobody wrote fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture
def prefill_launches(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The sequences of every prefill-kernel launch, in tile order."""
    launches: list[list[int]] = []
    launch = triton_ops.prefill_attention

    def spy(*args, **kwargs):
        launches.append(args[7][:, 0].tolist())  # tile_map
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "prefill_attention", spy)
    return launches


def batch_with_fresh_rows(specs: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 0):
    """(query, k_cache, v_cache, meta, key, value): `key` and `value` are the step's own rows, as the model stores
    them into the pool before attention."""
    query, k_cache, v_cache, meta = random_paged_batch(specs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, seed=seed)
    key = k_cache.view(-1, KV_HEADS, HEAD_DIM)[meta.slot_mapping]
    value = v_cache.view(-1, KV_HEADS, HEAD_DIM)[meta.slot_mapping]
    return query, k_cache, v_cache, meta, key, value


def assert_matches_torch(got: torch.Tensor, query, k_cache, v_cache, meta, window: int | None = None) -> None:
    want = TorchOps().attention(query, k_cache, v_cache, meta, 0.2, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_step_of_chunks_from_scratch_of_40_33_and_17_tokens_launches_no_prefill_kernel(prefill_launches) -> None:
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows([(0, 40), (0, 33), (0, 17)])
    ops = TritonOps()
    planned = ops.plan(meta, k_cache, HEADS, torch.float32)
    fresh = planned.plan.fresh
    assert fresh.bounds == [0, 40, 73, 90] and fresh.rows is None and fresh.first_row == 0 and fresh.longest == 40
    assert fresh.cu_seqlens.tolist() == [0, 40, 73, 90] and planned.plan.kept_tiles == 0
    got = ops.attention(query, k_cache, v_cache, planned, 0.2, None, key, value)
    assert prefill_launches == []
    assert_matches_torch(got, query, k_cache, v_cache, meta)


def test_a_mixed_step_gathers_fresh_chunks_around_a_cached_chunk_and_two_decodes(prefill_launches) -> None:
    """Rows 0-39 and 61-110 are fresh (sequences 0, 3 and 4); the chunk after 30 cached tokens keeps its one 64-row
    tile, first in the map, and the decodes (sequences 2 and 5) are served by index as before."""
    specs = [(0, 40), (30, 20), (60, 1), (0, 33), (0, 17), (90, 1)]
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows(specs, seed=1)
    ops = TritonOps(decode_min_segment=32)
    planned = ops.plan(meta, k_cache, HEADS, torch.float32)
    plan = planned.plan
    assert plan.fresh.rows.tolist() == [*range(40), *range(61, 111)] and plan.fresh.bounds == [0, 40, 73, 90]
    assert plan.kept_tiles == 1 and plan.tile_map[:, 0].tolist() == [1, 0, 3, 4]
    assert plan.decode_rows.tolist() == [2, 5] and plan.decode_rows.data_ptr() % 16 == 0
    got = ops.attention(query, k_cache, v_cache, planned, 0.2, None, key, value)
    assert prefill_launches == [[1]]
    assert_matches_torch(got, query, k_cache, v_cache, meta)


def test_fresh_chunks_after_a_cached_chunk_and_a_decode_are_one_slice_from_row_21(prefill_launches) -> None:
    specs = [(30, 20), (60, 1), (0, 40), (0, 33)]
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows(specs, seed=2)
    ops = TritonOps()
    planned = ops.plan(meta, k_cache, HEADS, torch.float32)
    assert planned.plan.fresh.rows is None and planned.plan.fresh.first_row == 21
    got = ops.attention(query, k_cache, v_cache, planned, 0.2, None, key, value)
    assert prefill_launches == [[0]]
    assert_matches_torch(got, query, k_cache, v_cache, meta)


@pytest.mark.parametrize(("window", "launched"), [(20, [0, 2, 3]), (48, [0])], ids=["shorter", "longer"])
def test_a_window_shorter_than_the_40_token_fresh_chunk_keeps_every_chunk_on_the_kernel(
        prefill_launches, window: int, launched: list[int]) -> None:
    """A 20-token window hides keys of the 40-token chunk: the whole map runs, fresh tiles last. A 48-token window
    hides none of a fresh chunk's keys (it still hides 2 of the 50-token cached sequence's, on the kernel)."""
    specs = [(30, 20), (60, 1), (0, 40), (0, 33)]
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows(specs, seed=3)
    ops = TritonOps()
    got = ops.attention(query, k_cache, v_cache, meta, 0.2, window, key, value)
    assert prefill_launches == [launched]
    assert_matches_torch(got, query, k_cache, v_cache, meta, window)


def test_without_the_fresh_rows_every_chunk_runs_on_the_kernel(prefill_launches) -> None:
    query, k_cache, v_cache, meta, _, _ = batch_with_fresh_rows([(0, 40), (30, 20)], seed=4)
    got = TritonOps().attention(query, k_cache, v_cache, meta, 0.2)
    assert prefill_launches == [[1, 0]]
    assert_matches_torch(got, query, k_cache, v_cache, meta)


def test_a_cache_of_another_dtype_keeps_fresh_chunks_on_the_kernel_that_reads_it(prefill_launches) -> None:
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows([(0, 40)], seed=5)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    ops = TritonOps()
    planned = ops.plan(meta, k_cache, HEADS, torch.float32)
    assert planned.plan.fresh is None
    got = ops.attention(query, k_cache, v_cache, planned, 0.2, None, key, value)
    assert prefill_launches == [[0]]
    assert_matches_torch(got, query, k_cache, v_cache, meta)


def test_the_batch_invariant_path_ignores_the_fresh_rows_bit_for_bit(prefill_launches) -> None:
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows([(0, 40), (30, 20), (60, 1)], seed=6)
    ops = TritonOps(batch_invariant=True)
    planned = ops.plan(meta, k_cache, HEADS, torch.float32)
    assert planned.plan.fresh is None
    with_rows = ops.attention(query, k_cache, v_cache, planned, 0.2, None, key, value)
    without = ops.attention(query, k_cache, v_cache, planned, 0.2)
    assert prefill_launches == [[2, 1, 0]] * 2  # every sequence, the most KV first
    assert torch.equal(with_rows, without)
    assert_matches_torch(with_rows, query, k_cache, v_cache, meta)


def test_one_varlen_call_gets_the_cumulative_lengths_0_40_73_90_and_the_longest_chunk(monkeypatch) -> None:
    """What a GPU with torch's `varlen_attn` runs, here through a CPU stand-in with its signature that attends
    each span its cumulative lengths name: so wrong lengths or a wrong longest chunk fail the comparison."""
    calls = []

    def varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):
        bounds = cu_seq_q.tolist()
        calls.append((bounds, max_q))
        assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k and window_size == (-1, 0) and enable_gqa
        assert max_q == max(end - start for start, end in zip(bounds, bounds[1:]))
        out = torch.empty_like(q)
        for start, end in zip(bounds, bounds[1:]):
            one = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                *one, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        return out

    monkeypatch.setattr(fresh_chunks, "varlen_attention", lambda device_type: varlen)
    specs = [(0, 40), (30, 20), (0, 33), (0, 17), (60, 1)]
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows(specs, seed=8)
    got = TritonOps().attention(query, k_cache, v_cache, meta, 0.2, None, key, value)
    assert calls == [([0, 40, 73, 90], 40)]
    assert_matches_torch(got, query, k_cache, v_cache, meta)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_fresh_chunks_match_torch(dtype: torch.dtype) -> None:
    query, k_cache, v_cache, meta, key, value = batch_with_fresh_rows([(0, 37), (20, 9), (0, 24)], dtype, seed=7)
    got = TritonOps().attention(query, k_cache, v_cache, meta, 0.2, None, key, value)
    want = TorchOps().attention(query, k_cache, v_cache, meta, 0.2)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_the_model_hands_its_fresh_rows_to_attention(prefill_launches) -> None:
    """A step of two prompts from scratch (20 and 9 tokens) and a decode through a 2-layer model: the chunks never
    reach the prefill kernel, and the logits equal the torch path's."""
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    q_lens, seq_lens = [20, 9, 1], [20, 9, 13]
    positions = torch.cat([torch.arange(20), torch.arange(9), torch.tensor([12])])
    owners = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    slots = tables[owners, positions // 8].long() * 8 + positions % 8
    meta = AttentionMetadata(
        query_start=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, slot_mapping=slots,
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(9))
    logits = []
    for ops in (TritonOps(), TorchOps()):
        gen = torch.Generator().manual_seed(10)  # the decode's 12 cached tokens: the same random KV for both
        caches = [(torch.randn(9, 8, 2, 16, generator=gen), torch.randn(9, 8, 2, 16, generator=gen)) for _ in range(2)]
        logits.append(tiny_llama(ops, num_layers=2)(ids, positions, caches, meta, torch.tensor([19, 28, 29])))
    assert prefill_launches == []
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=8))
def test_the_fresh_layout_lists_exactly_the_rows_of_the_fresh_chunks(steps: list[tuple[int, bool]]) -> None:
    query_lens = np.array([n for n, _ in steps])
    fresh = np.array([s for s, (_, is_fresh) in enumerate(steps) if is_fresh], dtype=np.int64)
    if not len(fresh):
        return
    bounds, rows, first_row = fresh_layout(query_lens, fresh)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    want = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in fresh])
    assert bounds.tolist() == [0, *np.cumsum(query_lens[fresh]).tolist()]
    got = np.arange(first_row, first_row + bounds[-1]) if rows is None else rows
    assert got.tolist() == want.tolist()


def test_long_16_bit_chunks_on_hopper_take_the_table_row_of_their_kind(monkeypatch) -> None:
    """What an H200 would launch (the interpreter always takes 64-row tiles): chunks of 512 after 600 cached tokens
    take the after-cached row, a step of fresh chunks the from-scratch row; a 100-token chunk and fp32 the default."""
    for module in (triton_ops, triton_attention):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(triton_ops, "_hopper", lambda device: True)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # fp32 dots as TF32, no warning
    monkeypatch.setattr(triton_ops, "HOPPER_PREFILL_TILES", {(32, True): (64, 128, 8, 4), (32, False): (128, 32, 4, 2)})
    launches = []
    monkeypatch.setattr(triton_ops, "prefill_attention", lambda *args: launches.append(args[9:13]))
    for specs, dtype, want in (([(600, 512), (0, 700)], torch.bfloat16, (64, 128, 8, 4)),
                               ([(0, 700), (0, 600)], torch.bfloat16, (128, 32, 4, 2)),
                               ([(600, 100)], torch.bfloat16, (64, 64, 4, 3)),
                               ([(600, 512)], torch.float32, (128, 64, 4, 3))):
        query, k_cache, v_cache, meta = random_paged_batch(specs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype)
        TritonOps().attention(query, k_cache, v_cache, meta, 0.2)  # no fresh rows: every chunk on the kernel
        assert launches.pop() == want
