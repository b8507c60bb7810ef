"""engine.batch_invariant on the Triton path, under the interpreter (tests/conftest.py): a row's linear outputs and
attention outputs are bitwise the same whatever shares its call or step, however its prompt is chunked, and
whether its position runs as a decode or inside a chunk; the MoE and LoRA tiles stop following the step.

What the interpreter cannot show: GPU rounding (TF32, MMA layouts, fused multiply-adds). The tests pin the
choices that decide it on a GPU (fixed tiles, one kernel, every KV tile masked) and the arithmetic order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime import interpreter

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton import lora as triton_lora
from batchprefill.kernels.triton import moe as triton_moe
from batchprefill.kernels.triton import ops as triton_ops
from batchprefill.kernels.triton.matmul import _linear_kernel, invariant_linear
from batchprefill.kernels.triton.ops import TritonOps
from batchprefill.model.moe import route
from batchprefill.sampling_params import SamplingParams
from tests.synthetic import Entry, Sequence, attention_of_entries, random_sequences, tiny_llama

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # bf16: the interpreter's casts truncate


@pytest.fixture(autouse=True)
def _interpreted_dots_sum_each_output_in_one_order(monkeypatch) -> None:
    """The interpreter runs `tl.dot` as numpy's matmul, whose BLAS may sum an output's products in an order that
    follows its row's place in the tile: OpenBLAS's Haswell kernel (AMD EPYC Zen 3, AVX2) gives a 32 x 32 float32
    product's rows other bits under 20 of 20 row permutations, where a GPU's MMA computes an output the same way
    wherever its row sits. Here every output is its products summed in k order, so what the tests pin is the
    kernel's own arithmetic order, on any CPU."""
    matmul = interpreter.InterpreterBuilder.create_dot

    def dot_in_k_order(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: not used by these kernels
            return matmul(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, w, acc_dtype = _values(a), _values(b), d.data.dtype
        products = np.zeros(np.broadcast_shapes(d.data.shape, x.shape[:-1] + w.shape[-1:]), acc_dtype)
        for k in range(x.shape[-1]):
            products += x[..., :, k, None].astype(acc_dtype) * w[..., None, k, :].astype(acc_dtype)
        return interpreter.TensorHandle(products + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot_in_k_order)


def _values(handle) -> np.ndarray:
    """An interpreter tensor's numbers (it keeps bfloat16 as its uint16 bits)."""
    if handle.dtype == tl.bfloat16:
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
def test_a_row_of_the_invariant_linear_is_the_same_among_1_5_33_or_90_rows_and_in_any_order(dtype) -> None:
    """100 inputs (not a multiple of the 32-deep steps) to 70 outputs with a bias: rows 0..m-1 of a call on m rows
    equal the same rows of the 90-row call, and a shuffled batch gives the shuffled rows."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(70, 100, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype)
    x = torch.randn(90, 100, generator=gen).to(dtype)
    full = invariant_linear(x, weight, bias)
    assert full.dtype == dtype and full.shape == (90, 70)
    _close(full, F.linear(x.float(), weight.float(), bias.float()), dtype)
    for m in (1, 5, 33):
        assert torch.equal(invariant_linear(x[:m], weight, bias), full[:m])
    for seed in (1, 2):
        order = torch.randperm(90, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(invariant_linear(x[order], weight, bias), full[order])
    assert torch.equal(invariant_linear(x.view(9, 10, 100), weight, bias), full.view(9, 10, 70))
    assert invariant_linear(x[:0], weight, bias).shape == (0, 70)


def test_the_row_count_is_not_specialized_so_one_compiled_linear_serves_every_batch() -> None:
    """Triton would otherwise compile M == 1 and M % 16 == 0 apart: another variant, perhaps other code."""
    declared = _linear_kernel.kwargs if hasattr(_linear_kernel, "kwargs") else vars(_linear_kernel)
    assert "M" in declared["do_not_specialize"] and "M" in declared["do_not_specialize_on_alignment"]


# Attention: a step computes, for each entry (sequence, first position, count), the queries of those positions over
# the cache of all positions up to them (tests/synthetic.py).
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 1, 32, 16
LONG = 150  # three 64-token KV tiles, the last one partial


def _sequences(lengths: list[int], dtype: torch.dtype) -> list[Sequence]:
    return random_sequences(lengths, Q_HEADS, KV_HEADS, HEAD_DIM, dtype)


def _step(ops, seqs: list[Sequence], entries: list[Entry], window: int | None = None) -> dict:
    return attention_of_entries(ops, seqs, entries, BLOCK_SIZE, window)


def _differing(got: dict, want: dict) -> list:
    """The (sequence, position) keys of `got` whose rows differ in any bit from `want`'s."""
    return [key for key, row in got.items() if not torch.equal(row, want[key])]


SPLITS = {
    "chunks-at-37-64-130": [[(0, 0, 37)], [(0, 37, 27)], [(0, 64, 66)], [(0, 130, 20)]],
    "last-two-as-decodes": [[(0, 0, 148)], [(0, 148, 1)], [(0, 149, 1)]],
    "beside-a-chunk-and-decodes": [[(1, 0, 90), (0, 0, 100), (2, 39, 1)], [(2, 40, 1), (0, 100, 50), (1, 90, 1)]],
    "decodes-beside-chunks": [
        [(1, 0, 90), (0, 0, 147)],
        [(0, 147, 1), (1, 90, 1)],
        [(2, 0, 41), (0, 148, 1)],
        [(0, 149, 1), (2, 41, 1)],
    ],
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_150_token_prompt_gives_the_same_bits_chunked_at_37_64_130_as_decodes_or_beside_other_rows(dtype) -> None:
    """Sequence 0 (150 tokens) alone in one chunk is the reference; split into four chunks, ending in two decodes,
    or sharing its steps with a 90-token chunk and decodes of a 42-token sequence, every position of it comes out
    bitwise the same. The reference is also the torch path's attention."""
    seqs = _sequences([LONG, 91, 42], dtype)
    ops = TritonOps(batch_invariant=True)
    alone = _step(ops, seqs, [(0, 0, LONG)])
    want = _step(TorchOps(), seqs, [(0, 0, LONG)])
    _close(torch.stack(list(alone.values())), torch.stack(list(want.values())), dtype)
    for name, steps in SPLITS.items():
        for entries in steps:
            rows = {key: row for key, row in _step(ops, seqs, entries).items() if key[0] == 0}
            assert _differing(rows, alone) == [], name


def test_a_decode_split_into_segments_differs_from_its_chunk_by_default_and_not_when_invariant() -> None:
    """The default serves position 149 as a decode split into 16-token segments and merged: close to the same
    position inside a chunk, but not the same bits. Invariant, the same settings give the chunk's bits."""
    seqs = _sequences([LONG], torch.float32)
    for invariant in (False, True):
        ops = TritonOps(decode_min_segment=16, decode_target_programs=64, batch_invariant=invariant)
        in_chunk = _step(ops, seqs, [(0, 0, LONG)])
        as_decode = _step(ops, seqs, [(0, LONG - 1, 1)])
        _close(as_decode[0, LONG - 1], in_chunk[0, LONG - 1], torch.float32)
        assert torch.equal(as_decode[0, LONG - 1], in_chunk[0, LONG - 1]) == invariant


def test_under_a_40_token_window_a_chunked_prompt_and_its_decodes_keep_the_one_chunk_bits() -> None:
    """Windowed tiles start at the first row's window rounded down to a whole tile, so rows whose window starts
    later walk tiles they cannot see; those leave their state untouched, so the bits stay."""
    seqs = _sequences([LONG, 91], torch.float32)
    ops = TritonOps(batch_invariant=True)
    alone = _step(ops, seqs, [(0, 0, LONG)], window=40)
    want = _step(TorchOps(), seqs, [(0, 0, LONG)], window=40)
    _close(torch.stack(list(alone.values())), torch.stack(list(want.values())), torch.float32)
    for entries in ([(0, 0, 70)], [(1, 0, 91), (0, 70, 79)], [(0, 149, 1), (1, 90, 1)]):
        rows = {key: row for key, row in _step(ops, seqs, entries, window=40).items() if key[0] == 0}
        assert _differing(rows, alone) == []


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    cuts=st.lists(st.integers(1, LONG - 1), min_size=1, max_size=3, unique=True),
    companions=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 20)), min_size=0, max_size=2),
)
def test_any_chunking_of_a_150_token_prompt_beside_any_companions_keeps_its_bits(cuts, companions) -> None:
    """Random cut points for sequence 0, and in every step the same random companions (a 91-token sequence at a
    drawn position with a drawn number of queries)."""
    seqs = _sequences([LONG, 111], torch.float32)
    ops = TritonOps(batch_invariant=True)
    alone = _step(ops, seqs, [(0, 0, LONG)])
    bounds = [0, *sorted(cuts), LONG]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        entries = [(1, start, count) for start, count in companions] + [(0, lo, hi - lo)]
        rows = {key: row for key, row in _step(ops, seqs, entries).items() if key[0] == 0}
        assert _differing(rows, alone) == []


def test_an_invariant_plan_tiles_chunks_of_600_and_200_and_two_decodes_in_64_row_tiles_with_no_split(
    monkeypatch,
) -> None:
    """Off the interpreter the default takes 128-row tiles for these chunks and sends the decodes to the decode
    kernel; invariant, 10 + 4 tiles of 64 rows plus one tile per decode, nothing split."""
    monkeypatch.setattr(triton_ops, "interpreting", lambda: False)
    specs = [(0, 600), (50, 200), (300, 1), (20, 1)]
    meta = AttentionMetadata(
        query_start=torch.zeros(5, dtype=torch.int32),
        seq_lens=torch.zeros(4, dtype=torch.int32),
        block_tables=torch.zeros(4, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_lens_host=[q for _, q in specs],
        seq_lens_host=[c + q for c, q in specs],
    )
    k_cache = torch.zeros(1, BLOCK_SIZE, 2, HEAD_DIM)
    default = TritonOps().plan(meta, k_cache, 4, torch.bfloat16).plan
    assert default.block_m == 128 and default.decode_rows.tolist() == [2, 3]
    plan = TritonOps(batch_invariant=True).plan(meta, k_cache, 4, torch.bfloat16).plan
    assert (plan.block_m, plan.num_decodes, plan.decode_rows, plan.num_segments) == (64, 0, None, 1)
    assert np.bincount(plan.tile_map[:, 0].numpy()).tolist() == [10, 4, 1, 1]


def test_an_invariant_decode_only_step_reads_its_tiles_from_one_persistent_tensor() -> None:
    """A decode-only step copies nothing to the device (a CUDA graph can capture it): 3 decodes get tiles (0, 0),
    (1, 0), (2, 0), and a later step of 2 a view of the same storage."""
    ops = TritonOps(batch_invariant=True)
    k_cache = torch.zeros(1, BLOCK_SIZE, 2, HEAD_DIM)

    def decodes(n: int) -> torch.Tensor:
        meta = AttentionMetadata(
            query_start=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.ones(n, dtype=torch.int32),
            block_tables=torch.zeros(n, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(n, dtype=torch.int64),
            query_lens_host=[1] * n,
            seq_lens_host=[9] * n,
        )
        return ops.plan(meta, k_cache, 4, torch.float32).plan.tile_map

    three = decodes(3)
    assert three.tolist() == [[0, 0], [1, 0], [2, 0]]
    assert decodes(2).data_ptr() == three.data_ptr() and ops._host is None


def test_invariant_moe_and_lora_tiles_do_not_follow_the_step_while_the_default_ones_do(monkeypatch) -> None:
    """Off the interpreter: MoE tiles for 2, 400 and 4000 (token, expert) pairs over 8 experts, LoRA tiles for
    longest segments of 1, 40 and 500 tokens."""
    for module in (triton_moe, triton_lora):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    assert {triton_moe._block_m(p, 8) for p in (2, 400, 4000)} == {16, 32, 64}
    assert {triton_moe._block_m(p, 8, batch_invariant=True) for p in (2, 400, 4000)} == {32}
    assert {triton_lora._block_m(n) for n in (1, 40, 500)} == {16, 32, 64}
    assert {triton_lora._block_m(n, batch_invariant=True) for n in (1, 40, 500)} == {32}


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_invariant_moe_token_gives_the_same_bits_among_1_or_23_tokens_and_in_any_order(dtype) -> None:
    """23 tokens, 4 experts, top 3: each token's output alone, or in a shuffled batch, is its row of the full
    batch; and the full batch is the torch path's."""
    gen = torch.Generator().manual_seed(3)
    experts = ExpertWeights(
        (torch.randn(4, 2 * 24, 32, generator=gen) / 32**0.5).to(dtype),
        (torch.randn(4, 32, 24, generator=gen) / 24**0.5).to(dtype),
    )
    x = torch.randn(23, 32, generator=gen).to(dtype)
    weights, ids = route(torch.randn(23, 4, generator=gen), 3, normalize=False)
    ops = TritonOps(batch_invariant=True)
    full = ops.moe(x, experts, weights, ids)
    _close(full, TorchOps().moe(x, ExpertWeights(experts.gate_up.clone(), experts.down.clone()), weights, ids), dtype)
    assert torch.equal(ops.moe(x[5:6], experts, weights[5:6], ids[5:6]), full[5:6])
    order = torch.randperm(23, generator=torch.Generator().manual_seed(4))
    assert torch.equal(ops.moe(x[order], experts, weights[order], ids[order]), full[order])


# (max_num_seqs, max_batched_tokens, padded decode, pool blocks); the 7-block pool, with output blocks not reserved
# at admission, preempts one request, whose decoded tokens are then recomputed as a prompt.
ENGINE_RUNS = [(1, 8, "off", 64), (4, 64, "off", 64), (4, 16, "eager", 64), (4, 64, "off", 7)]


def test_an_engine_on_invariant_triton_gives_the_same_logprobs_whatever_the_batch_chunks_decode_path_or_preemption():
    """Three prompts (33, 26 and 5 tokens, the second sharing the first's first 24), 6 greedy tokens each, with
    their logprobs: one sequence at a time with 8-token chunks, four at a time with 64, four at a time through the
    padded decode buffers a CUDA graph replays, and four at a time in a pool so small that one is preempted; every
    token and logprob is bitwise the same. The same engine without batch_invariant gives other bits in all but the
    second run (checked when this test was written): 8- and 16-token budgets leave 1-token chunks, which the default
    runs as split decodes, and the preempted request's decoded tokens are recomputed by the prefill kernel.
    (float32 only: at this size bfloat16's rounding hides the differences, and the interpreter runs bfloat16 dots in
    float32 anyway.)"""
    prompts = [list(range(7, 40)), list(range(7, 31)) + [5, 6], [9] * 5]
    # Two layers, so a position's attention output reaches the next layer's keys, which every later token reads;
    # 16-token KV tiles and segments: the default splits any decode context of 17 tokens or more and merges it.
    ops = TritonOps(block_n=16, decode_min_segment=16, decode_target_programs=64, batch_invariant=True)
    model = tiny_llama(ops, num_layers=2)
    runs, cached, preempted = [], [], []
    for max_num_seqs, max_batched_tokens, padded, num_blocks in ENGINE_RUNS:
        settings = EngineSettings(
            block_size=8, max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs, reserve_output_blocks=False
        )
        config = EngineConfig(settings, num_blocks=num_blocks, padded_decode=padded)
        engine = Engine(model, config, lambda ids: "", ("tiny",), torch.float32, torch.device("cpu"))
        sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
        requests = [Request(i, p, sampling) for i, p in enumerate(prompts)]
        runs.append({r.request_id: (r.output_token_ids, r.output_logprobs) for r in engine.generate(requests)})
        cached.append(sum(r.num_cached_tokens for r in requests))
        preempted.append(engine.scheduler.preemptions)
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert cached[:3] == [24, 24, 24]  # the second prompt reads the first's three blocks
    assert preempted == [0, 0, 0, 1]
    assert all(len(tokens) == len(logprobs) == 6 for tokens, logprobs in runs[0].values())
