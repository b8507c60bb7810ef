"""FP8 KV pools (engine.kv_cache_dtype=fp8, fp8_e4m3, fp8_e5m2): every KV store rounds as the torch one does, and
every attention path over an FP8 pool gives what float32 attention gives over the same values widened: the FP8
rounding is the data, the kernels add nothing beyond float32 (or bfloat16) arithmetic. The C++ pair-product walks
for a bfloat16 model take each softmax weight as one bfloat16, as GPU flash attention does: within 2^-8 of the
weighted mean of |value| (a bfloat16's rounding), which the bfloat16 output then rounds to anyway."""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch

import batchprefill
import batchprefill.pipeline.build_engine as build_engine
from batchprefill import JobError
from batchprefill.engine import kv_cache
from batchprefill.kernels.fp8_kv import to_cache
from batchprefill.kernels.native import build as native
from batchprefill.kernels.native import elementwise as native_elementwise
from batchprefill.kernels.native import paged_decode
from batchprefill.kernels.torch import elementwise as torch_elementwise
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton.ops import TritonOps
from batchprefill.model.families import read_config
from batchprefill.model.loader import resolve_kv_dtype
from tests.synthetic import random_paged_batch
from tests.test_api import PROMPTS
from tests.test_paged_decode import assert_within_bfloat16_weights, both_paths, decodes
from tests.test_prefix_groups import flat_batch

E4M3 = torch.float8_e4m3fn
FP8 = [E4M3, torch.float8_e5m2]
IDS = ["e4m3", "e5m2"]


def every_code_and_midpoint(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, every midpoint between neighbours (the ties), values a hair above the
    midpoints, their negatives, and values far past the largest: `[n, 1, 64]` float32."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2**-20), -mids, torch.tensor([1e6, -1e6, 7e4, 500.0])])
    values = torch.cat([values, values.new_zeros(-len(values) % 64)])
    return values.view(-1, 1, 64)


def pools(tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(tokens, 1, 1, 64, dtype=dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_the_cpp_store_rounds_every_tie_and_saturates_as_the_torch_store(dtype, source):
    values = every_code_and_midpoint(dtype).to(source)
    slots = torch.arange(len(values))
    cpp, reference = pools(len(values), dtype), pools(len(values), dtype)
    native = native_elementwise.load()
    assert native is not None, "the C++ store must build here"
    native.store_kv(values, values, *cpp, slots)
    torch_elementwise.store_kv(values, values, *reference, slots)
    for got, want in zip(cpp, reference):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    largest = torch.finfo(dtype).max  # 1e6 saturates (e5m2: no infinity), the codes round trip exactly
    assert reference[0].float().abs().max() == largest and reference[0].float().isfinite().all()
    codes = values.float().flatten()[: (values.float().abs() <= largest).sum()]
    assert torch.equal(to_cache(codes, dtype).float()[:100], codes[:100])


def every_bit_pattern(source: torch.dtype) -> torch.Tensor:
    """bfloat16: all 65,536 bit patterns (NaNs, infinities, subnormals); float32: 2^18 random bit patterns, 2^18 with
    exponents around the FP8 range (2^-27 to 2^18, each mantissa bit random), and the same negated."""
    if source == torch.bfloat16:
        return torch.arange(-2**15, 2**15, dtype=torch.int16).view(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    anything = torch.randint(-2**31, 2**31, (2**18,), generator=generator, dtype=torch.int64).to(torch.int32)
    mantissas = torch.randint(0, 2**23, (2**18,), generator=generator, dtype=torch.int32)
    exponents = torch.randint(100, 146, (2**18,), generator=generator, dtype=torch.int32)
    near = (exponents << 23 | mantissas).view(torch.float32)
    return torch.cat([anything.view(torch.float32), near, -near])


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize(("source", "width"), [(torch.float32, 24), (torch.bfloat16, 64)])
def test_the_cpp_store_gives_the_torch_casts_byte_for_every_bfloat16_and_786432_float32_patterns(
        dtype, source, width):
    # infinities and the rest saturated, ties to even, 16 lanes at a time (rows of 24 end in an 8-lane tail); a NaN
    # gives the NaN code 0x7F with its sign, where torch's sign depends on its own vector path (a lone bfloat16 NaN
    # 0x7FC0 casts to 0x7F, the same in a tensor of 65,536 to 0xFF), so NaNs compare without their sign
    values = every_bit_pattern(source).view(-1, 1, width)
    slots = torch.arange(len(values))
    cpp, reference = ([torch.zeros(len(values), 1, 1, width, dtype=dtype) for _ in range(2)] for _ in range(2))
    native = native_elementwise.load()
    assert native is not None, "the C++ store must build here"
    native.store_kv(values, -values, *cpp, slots)
    torch_elementwise.store_kv(values, -values, *reference, slots)
    nan = values.flatten().isnan()
    assert nan.sum() >= 254 and (~nan).sum() >= 65_000
    for got, want, signed in zip(cpp, reference, (values, -values)):
        got, want = got.view(torch.uint8).flatten(), want.view(torch.uint8).flatten()
        assert torch.equal(got[~nan], want[~nan])
        assert bool((got[nan] & 0x7F == 0x7F).all()) and bool((want[nan] & 0x7F == 0x7F).all())
        assert torch.equal(got[nan] >> 7, signed.flatten()[nan].view(torch.int16 if source == torch.bfloat16
                                                                     else torch.int32).lt(0).to(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_the_triton_store_rounds_every_tie_and_saturates_as_the_torch_store(dtype, source):
    values = every_code_and_midpoint(dtype).to(source)
    noise = torch.randn(64, 1, 64, generator=torch.Generator().manual_seed(0)) * 10  # carries as 1.9375 -> 2
    slots = torch.arange(len(values) + 64)
    for key in (values, noise.to(source)):
        triton, reference = pools(len(slots), dtype), pools(len(slots), dtype)
        key = key.reshape(-1, 1, 64)
        TritonOps().store_kv(key, key, *triton, slots[: len(key)])
        torch_elementwise.store_kv(key, key, *reference, slots[: len(key)])
        for got, want in zip(triton, reference):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# sequences as (cached context, new queries): a chunk after a cached prefix, a chunk alone, two decodes
PREFILL_AND_DECODE = [(40, 25), (0, 20), (77, 1), (130, 1)]


def fp8_batch(dtype: torch.dtype, query_dtype: torch.dtype, seed: int = 0):
    query, k_cache, v_cache, meta = random_paged_batch(PREFILL_AND_DECODE, 6, 2, 64, 16, torch.float32, seed=seed)
    k_cache, v_cache = (to_cache(cache * 4, dtype) for cache in (k_cache, v_cache))  # some values reach e4m3 subnormals
    return query.to(query_dtype), k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize(("query_dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_prefill_and_decode_over_an_fp8_pool_equal_float32_attention_on_the_widened_pool(
        dtype, query_dtype, tolerance):
    query, k_cache, v_cache, meta = fp8_batch(dtype, query_dtype)
    got = TritonOps(block_m=16, block_n=32).attention(query, k_cache, v_cache, meta, 0.125)
    want = TorchOps(native=False).attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("ops", [dict(native=True), dict(native=False), dict(batch_invariant=True)],
                         ids=["cpp-walks", "gathered", "batch-invariant"])
def test_the_cpu_paths_over_an_fp8_pool_equal_float32_attention_on_the_widened_pool(dtype, ops):
    # the C++ walks (decodes and the chunk after a cached block; every row under batch invariance) or the gathered
    # torch calls (decode_groups.py, prefix_groups.py, a chunk alone), float32 queries: the widening is exact, so
    # float32 noise only (scores up to about 30 here: the sums' order moves outputs by up to 2e-5)
    query, k_cache, v_cache, meta = fp8_batch(dtype, torch.float32, seed=1)
    got = TorchOps(**ops).attention(query, k_cache, v_cache, meta, 0.125)
    want = TorchOps(native=False).attention(query, k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 128), (6, 3, 40)])
def test_the_cpp_decode_walks_over_an_fp8_pool_equal_the_gathered_float32_path(dtype, query_dtype, heads,
                                                                                kv_heads, dim):
    # a set of 3 and one of 6 decodes (18 rows at 3 query heads per KV head: the vectorized shared walk), lone
    # decodes; heads of 64 and 128 take the AVX-512 widening, 40 its scalar tail. bfloat16 queries give bfloat16
    # outputs: one rounding, 2^-8 of values below 5
    groups = [(3, [1, 15, 16]), (2, [32, 17, 7, 1, 16, 50]), (0, [5]), (0, [32])]
    got, want, plan = both_paths(groups, heads, kv_heads, dim, 16, seed=dim, dtype=dtype, query_dtype=query_dtype)
    assert type(plan).__name__ == "PagedPlan"
    tolerance = 1e-5 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)



def test_fp8_by_name_is_e4m3_a_bad_name_lists_the_choices_and_auto_keeps_the_models_dtype():
    assert resolve_kv_dtype("fp8", torch.bfloat16) == resolve_kv_dtype("fp8_e4m3", torch.float32) == E4M3
    assert resolve_kv_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(JobError, match=r"engine.kv_cache_dtype 'fp4': choose auto, float32, .*fp8, fp8_e4m3, fp8_e5m2"):
        resolve_kv_dtype("fp4", torch.float32)


def test_an_fp8_pool_holds_twice_the_blocks_of_a_bfloat16_pool_in_the_same_memory(model_folder, monkeypatch):
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 (K and V) = 11,520 elements a token: 23,040 bytes in bfloat16,
    # 11,520 in FP8; 1 GiB of free memory is 2,912 blocks of 16 in bfloat16 and 5,825 in FP8
    config = read_config(model_folder)
    monkeypatch.setattr(kv_cache, "_free_memory", lambda device: float(1 << 30))
    blocks = {dtype: kv_cache.pool_blocks(config, dtype, torch.device("cpu"), 16, 1, None, 10**9)
              for dtype in (torch.bfloat16, E4M3, torch.float8_e5m2)}
    assert blocks == {torch.bfloat16: 2912, E4M3: 5825, torch.float8_e5m2: 5825}


def test_the_plan_counts_fp8_kv_at_one_byte_an_element(tmp_path):
    # the shipped model's 11,520 KV elements a token: 46,080 bytes in float32, 11,520 in FP8
    rows = {kv: batchprefill.plan(PROMPTS, **{"engine.kv_cache_dtype": kv, "model.dtype": "float32",
                                              "output.dir": str(tmp_path / kv)})
            for kv in ("auto", "fp8")}
    assert {kv: row["kv_bytes_per_token"] for kv, row in rows.items()} == {"auto": 46080, "fp8": 11520}


def test_a_job_with_fp8_kv_answers_as_with_float32_kv_and_its_cache_scope_names_the_kv_dtype(monkeypatch, capsys):
    # the shipped model greedy over 8 short prompts, 12 tokens each: FP8 K and V (7% error in an attention output,
    # kernels/fp8.py) leave the answers' first tokens as they were; the two jobs' blocks can never match; the
    # summary counts 46,080 bytes a token in float32 and 11,520 in FP8
    scopes = []
    engine = build_engine.Engine

    def spy(model, config, decode, scope, kv_dtype, *rest):
        scopes.append(scope)
        return engine(model, config, decode, scope, kv_dtype, *rest)

    monkeypatch.setattr(build_engine, "Engine", spy)
    texts = {kv: batchprefill.run(PROMPTS, **{"engine.kv_cache_dtype": kv, "sampling.max_tokens": 12,
                                              "output.plot": False, "output.progress": False}).table
             for kv in ("auto", "fp8")}
    answered = [a for a, b in zip(texts["auto"]["output_text"], texts["fp8"]["output_text"]) if a]
    assert len(answered) == 7 and all(texts["fp8"]["error"][i] is None for i in range(8) if i != 6)
    same_start = sum(a[:8] == b[:8] for a, b in zip(texts["auto"]["output_text"], texts["fp8"]["output_text"]) if a)
    assert same_start >= 6
    assert len(scopes) == 2 and scopes[0] != scopes[1]
    assert [str(s) for s in scopes[0] if "float8" in str(s) or "float32" in str(s)] == ["torch.float32"] * 2
    assert "torch.float8_e4m3fn" in scopes[1] and "torch.float32" in scopes[1]
    summary = capsys.readouterr().err
    assert " tokens in float32, 46,080 bytes a token" in summary
    assert " tokens in float8_e4m3fn, 11,520 bytes a token" in summary


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_the_cpp_walks_widen_every_fp8_code_exactly(dtype):
    # every finite code (e4m3: 253 values from -448 to 448, subnormals and zeros included) in K and V of 5 decodes,
    # shared and own blocks, heads of 64 (the vector widening and no scalar tail): a wrong code moves an output by
    # a share of its value, where float32 sums of values up to the format's largest (448, 57344) move it by 1e-5 of it
    tables, lens = decodes([(2, [16, 16, 16]), (0, [33, 40])], 16)
    query, k_cache, v_cache, meta = flat_batch([1] * 5, lens, tables, 6, 2, 64, 16, num_blocks=16, seed=0)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[codes.float().isfinite()]
    count = k_cache.numel()
    k_cache = codes[torch.arange(count) % len(codes)].view(k_cache.shape)
    v_cache = codes[torch.randperm(count, generator=torch.Generator().manual_seed(0)) % len(codes)].view(v_cache.shape)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 1e-3)
    want = TorchOps(native=False).attention(query, k_cache.float(), v_cache.float(), meta, 1e-3)
    torch.testing.assert_close(got, want, atol=1e-5 * torch.finfo(dtype).max, rtol=1e-5)


# lone decodes of 1 to 77 tokens (odd counts pair a token with itself, partial blocks), a set of 2 and one of 3 over
# shared blocks (too few rows for the row-vectorized walk: they take the pair products too), and a set of 6
PAIRED_GROUPS = [(2, [1, 15]), (1, [32, 17, 7]), (3, [1, 16, 2, 5, 9, 40]), (0, [5]), (0, [32]), (0, [1]), (0, [77])]


def bfloat16_exact_batch(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                         groups: list[tuple[int, list[int]]] = PAIRED_GROUPS, block: int = 16):
    tables, lens = decodes(groups, block)
    query, k_cache, v_cache, meta = flat_batch([1] * len(lens), lens, tables, heads, kv_heads, dim, block,
                                               num_blocks=max(map(max, tables)) + 1, seed=dim)
    # float32 queries that bfloat16 holds exactly take the pair products, as a bfloat16 model's do
    return query.bfloat16().float(), to_cache(k_cache * 4, dtype), to_cache(v_cache * 4, dtype), meta


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"),
                         [(9, 3, 64, 16), (6, 2, 128, 16), (4, 1, 256, 16), (9, 3, 64, 32), (4, 1, 256, 32)])
def test_bfloat16_queries_over_an_fp8_pool_take_pair_products_within_a_bfloat16_weights_rounding(
        dtype, heads, kv_heads, dim, block):
    # products of bfloat16 queries and FP8 keys are exact and the scores float32; only the weights are rounded, each to
    # one bfloat16: outputs up to about 15 here move by up to about 1.6e-2, 0.57-0.91 of the bound in these batches.
    # Blocks of 32 are walked 16 tokens at a time: until session 48 the second 16 read their values 16 pairs too far
    # (outputs of 1e37)
    query, k_cache, v_cache, meta = bfloat16_exact_batch(dtype, heads, kv_heads, dim, block=block)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 0.125)
    assert assert_within_bfloat16_weights(got, query, k_cache, v_cache, meta, 0.125).abs().max() > 10


# sets of 6, 11 and 17 decodes over 2, 3 and 1 shared blocks: at 3 query heads per KV head 18, 33 and 51 rows (one,
# three and four 16-row tiles, the last partly filled) walk the shared prefix vectorized across rows; at 4, 24 to 68
MANY_ROW_GROUPS = [(2, [1, 15, 16, 2, 9, 40]), (3, [1 + 3 * i for i in range(11)]), (1, [5] * 17)]


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 128), (4, 1, 256)])
def test_the_row_vectorized_shared_walk_over_an_fp8_pool_pairs_its_values_within_a_bfloat16_weights_rounding(
        dtype, heads, kv_heads, dim):
    # the shared walk's weights times values as bfloat16 pairs, each weight one bfloat16
    query, k_cache, v_cache, meta = bfloat16_exact_batch(dtype, heads, kv_heads, dim, MANY_ROW_GROUPS)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 0.125)
    assert assert_within_bfloat16_weights(got, query, k_cache, v_cache, meta, 0.125).abs().max() > 10


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("switched_off", [["-mno-avx512vbmi", "-mno-avx512bf16"], ["-mno-avx512f"]],
                         ids=["avx512-without-vbmi", "avx2"])
def test_builds_without_the_byte_tables_or_pair_products_give_float32_attention_over_an_fp8_pool(
        tmp_path, dtype, switched_off):
    # built here as for an AVX-512 CPU before Ice Lake (F16C widening, float32 walks) and for an AVX2 one, over
    # every finite FP8 code in K and V: float32 attention within 1e-4; this machine's build with its pair products
    # (bfloat16 weights) within their bound
    library = tmp_path / "build.so"
    subprocess.run([os.environ.get("CXX") or "c++", *native.FLAGS, *switched_off, "-o", str(library),
                    str(native.SOURCES / "paged_decode.cpp")], check=True, capture_output=True)
    query, k_cache, v_cache, meta = bfloat16_exact_batch(dtype, 9, 3, 64)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[codes.float().isfinite() & (codes.float().abs() < 64)]
    k_cache = codes[torch.arange(k_cache.numel()) % len(codes)].view(k_cache.shape)
    v_cache = codes[torch.randperm(v_cache.numel(), generator=torch.Generator().manual_seed(0)) % len(codes)].view(
        v_cache.shape)
    built = TorchOps()
    built._paged = paged_decode.PagedDecode(ctypes.CDLL(str(library)))
    want = TorchOps(native=False).attention(query, k_cache.float(), v_cache.float(), meta, 0.01)
    torch.testing.assert_close(built.attention(query, k_cache, v_cache, meta, 0.01), want, atol=1e-4, rtol=1e-4)
    assert_within_bfloat16_weights(TorchOps().attention(query, k_cache, v_cache, meta, 0.01), query, k_cache, v_cache,
                                   meta, 0.01)
