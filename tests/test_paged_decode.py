"""The C++ decode kernel reads the paged pool in place, a step's decodes in one call, and gives what gathering
each context (the torch path, decode_groups.py) gives."""

import ctypes
import os
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.intmath import cdiv
from batchprefill.kernels.native import build as native
from batchprefill.kernels.native import paged_decode
from batchprefill.kernels.torch.decode_groups import DecodePlan
from batchprefill.kernels.torch.ops import TorchOps, _route_chunks
from tests.test_prefix_groups import flat_batch


@pytest.fixture(scope="module")
def kernel() -> paged_decode.PagedDecode:
    built = paged_decode.load()
    assert built is not None, "the decode kernel must build here (a C++ compiler is on this machine)"
    return built


def decodes(groups: list[tuple[int, list[int]]], block: int) -> tuple[list[list[int]], list[int]]:
    """Block tables and lengths of decodes in groups (shared blocks, each member's own tokens), every block id
    distinct and scattered: [(2, [5, 17])] is two decodes over the same 2 shared blocks, with 5 and 17 own tokens."""
    tables, lens, next_block = [], [], 0
    for shared, owns in groups:
        prefix = list(range(next_block, next_block + shared))
        next_block += shared
        for own in owns:
            count = cdiv(own, block)
            tables.append(prefix + list(range(next_block, next_block + count)))
            next_block += count
            lens.append(shared * block + own)
    scatter = torch.randperm(next_block + 3, generator=torch.Generator().manual_seed(next_block)).tolist()
    return [[scatter[b] for b in table] for table in tables], lens


def both_paths(groups, heads, kv_heads, dim, block, seed, dtype=torch.float32, query_dtype=torch.float32):
    tables, lens = decodes(groups, block)
    query, k_cache, v_cache, meta = flat_batch([1] * len(lens), lens, tables, heads, kv_heads, dim, block,
                                               num_blocks=max(map(max, tables)) + 1, seed=seed)
    k_cache, v_cache, query = k_cache.to(dtype), v_cache.to(dtype), query.to(query_dtype)
    native_ops = TorchOps()
    plan = native_ops.plan(meta, k_cache, heads, query.dtype)
    got = native_ops.attention(query, k_cache, v_cache, plan, 0.125)
    # the gathered reference on the same values widened to float32, so a bfloat16 pool compares exactly
    want = TorchOps(native=False).attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    return got.float(), want, plan.plan.decodes


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"),
                         [(9, 3, 64, 16), (6, 2, 128, 16), (4, 4, 64, 32), (6, 3, 40, 16), (2, 1, 8, 4)])
def test_one_call_equals_the_gathered_path_for_lengths_around_block_edges(heads, kv_heads, dim, block):
    # own lengths 1, a block minus one, exactly one and two blocks, a block plus one; a group of 3 and one of 6
    # decodes (at 3 query heads per KV head, 9 and 18 rows: the second walks its prefix vectorized across
    # rows), and two decodes sharing nothing; heads of 64 and 128 take the AVX-512 path where the CPU has it,
    # 40 and 8 the plain one
    groups = [(3, [1, block - 1, block]), (2, [2 * block, block + 1, 7, 1, block, 3 * block + 2]), (0, [5]),
              (0, [2 * block])]
    got, want, plan = both_paths(groups, heads, kv_heads, dim, block, seed=dim + block)
    assert isinstance(plan, paged_decode.PagedPlan)
    assert torch.allclose(got, want, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 4), st.lists(st.integers(1, 40), min_size=1, max_size=9)),
                       min_size=1, max_size=4),
       per_kv=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 99))
def test_one_call_equals_the_gathered_path_for_any_groups(groups, per_kv, seed):
    got, want, _ = both_paths(groups, 2 * per_kv, 2, 16, 8, seed)
    assert torch.allclose(got, want, atol=1e-5)


def test_a_group_above_the_set_size_is_split_into_sets_that_each_read_the_prefix(kernel):
    # 40 decodes over one 3-block prefix at 3 query heads per KV head: 120 rows, so sets of 16 members (48
    # rows): 16 + 16 + 8, each walking the shared 3 blocks (48 tokens) once
    got, want, plan = both_paths([(3, list(range(1, 41)))], 9, 3, 64, 16, seed=3)
    assert plan.sets[:, 1:].tolist() == [[16, 48], [16, 48], [8, 48]]
    assert torch.allclose(got, want, atol=1e-5)


def test_sets_are_ordered_by_the_tokens_their_rows_read_largest_first(kernel):
    # a lone decode of 300 tokens reads more than the pair (2 x (32 + 5)): it goes first, the 20-token one last
    _, _, plan = both_paths([(0, [300]), (2, [5, 5]), (0, [20])], 6, 2, 16, 16, seed=1)
    assert plan.sets.tolist() == [[0, 1, 0], [1, 2, 32], [3, 1, 0]]


def test_a_bfloat16_pool_is_widened_exactly_before_the_float32_arithmetic():
    got, want, _ = both_paths([(2, [5, 16, 33]), (0, [7])], 9, 3, 64, 16, seed=4, dtype=torch.bfloat16)
    assert torch.allclose(got, want, atol=1e-5)


def assert_within_bfloat16_weights(got: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                                   v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Asserts `got` within what rounding each softmax weight to a bfloat16 can move float32 attention over the widened
    pool: |sum w'v - sum wv| / sum w <= 2^-8 sum w|v| / sum w (a bfloat16 keeps 8 significant bits, so each weight
    moves by at most 2^-8 of itself), plus 1e-5 for float32's sums; a bfloat16 `got` is the output rounded once more,
    by up to 2^-8 of itself. Returns that float32 attention."""
    reference = TorchOps(native=False)
    query = query.float()
    want = reference.attention(query, k_cache.float(), v_cache.float(), meta, scale)
    mean_magnitude = reference.attention(query, k_cache.float(), v_cache.float().abs(), meta, scale)
    bound = 2**-8 * mean_magnitude + 1e-5
    if got.dtype == torch.bfloat16:
        bound = bound + 2**-8 * want.abs()
    ratio = ((got.float() - want).abs() / bound).max()
    assert ratio <= 1, f"{ratio:.2f} times the bound"
    return want


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("round_queries", [True, False], ids=["bfloat16-valued-queries", "float32-queries"])
def test_a_set_walking_its_prefix_across_rows_of_a_bfloat16_pool_is_float32_attention_but_for_bfloat16_weights(
        dim, round_queries):
    # 6 decodes over 3 shared blocks at 3 query heads per KV head are 18 rows, so the set walks its prefix across
    # rows. Float32 queries holding bfloat16 values (a bfloat16 model's, widened for this path) take their scores
    # as bfloat16 pair products where the CPU has AVX512_BF16 (exact products: only the order of the float32 sums
    # moves) and their weights times values as pairs too, each weight rounded to one bfloat16. Other queries keep
    # the float32 FMAs: float32 attention within 1e-5. Scale 1/sqrt(128) is not a power of two: it multiplies the
    # scores, not the (then no longer bfloat16) queries.
    tables, lens = decodes([(3, [1, 15, 16, 40, 2, 17]), (0, [9])], 16)
    query, k_cache, v_cache, meta = flat_batch([1] * 7, lens, tables, 9, 3, dim, 16, num_blocks=64, seed=dim)
    if round_queries:
        query = query.bfloat16().float()
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    scale = dim**-0.5
    got = TorchOps().attention(query, k_cache, v_cache, meta, scale)
    if round_queries:
        assert_within_bfloat16_weights(got, query, k_cache, v_cache, meta, scale)
    else:
        want = TorchOps(native=False).attention(query, k_cache.float(), v_cache.float(), meta, scale)
        assert torch.allclose(got, want, atol=1e-5)


# Rounding the softmax weights to bfloat16 for the tile product (as GPU flash attention does) moves an output by
# up to about 2^-8 of the largest value it averages (values here are standard normal, below 5).
TILE_TOLERANCE = 2e-2


def test_bfloat16_queries_over_a_bfloat16_pool_walk_as_tile_matmuls_where_the_cpu_has_amx(kernel):
    # (Linux grants the tile registers on request; an AMD Zen 4 multiplies bfloat16 natively too, but has no tiles)
    assert kernel.uses_tiles(16, 64) == torch.cpu._is_amx_tile_supported()
    assert not kernel.uses_tiles(8, 64) and not kernel.uses_tiles(16, 40)  # blocks of 8, heads of 40: vector walks


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"),
                         [(9, 3, 64, 16), (14, 2, 64, 16), (6, 2, 128, 16), (4, 4, 64, 32), (32, 2, 64, 16)])
def test_the_tile_walks_equal_the_gathered_path_within_the_rounding_of_the_weights(heads, kv_heads, dim, block):
    # own lengths around the 16-token slices and the 128-token chunks of a walk (1, 15, 16, 17, 127, 128, 129,
    # 300), a group of 3 and one of 9 decodes (at 7 query heads per KV head, 63 rows: four row tiles) over shared
    # prefixes of 3 and 9 blocks, and lone decodes; 16 query heads per KV head fill one row tile exactly
    groups = [(3, [1, 15, 16]), (9, [17, 127, 128, 129, 300, 1, 2, 33, 64]), (0, [5]), (0, [257])]
    got, want, plan = both_paths(groups, heads, kv_heads, dim, block, seed=dim + heads, dtype=torch.bfloat16,
                                 query_dtype=torch.bfloat16)
    assert isinstance(plan, paged_decode.PagedPlan)
    assert float((got - want).abs().max()) < TILE_TOLERANCE
    assert float((got - want).abs().mean()) < TILE_TOLERANCE / 10


@settings(max_examples=15, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(1, 200), min_size=1, max_size=9)),
                       min_size=1, max_size=4),
       per_kv=st.sampled_from([1, 3, 7, 16]), seed=st.integers(0, 99))
def test_the_tile_walks_equal_the_gathered_path_for_any_groups(groups, per_kv, seed):
    got, want, _ = both_paths(groups, 2 * per_kv, 2, 64, 16, seed, dtype=torch.bfloat16, query_dtype=torch.bfloat16)
    assert float((got - want).abs().max()) < TILE_TOLERANCE


def test_a_cpu_with_bfloat16_but_no_amx_walks_a_bfloat16_pool_as_pair_products_within_their_weights_rounding(
        tmp_path):
    # built here without AMX, as -march=native makes it on an AMD Zen 4 (bfloat16 dot products, no tiles): the
    # vector walks take scores and weights times values as bfloat16 pair products, each weight one bfloat16
    library = tmp_path / "no_tiles.so"
    subprocess.run([os.environ.get("CXX") or "c++", *native.FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-o",
                    str(library), str(native.SOURCES / "paged_decode.cpp")], check=True, capture_output=True)
    vector = paged_decode.PagedDecode(ctypes.CDLL(str(library)))
    assert not vector.uses_tiles(16, 64)
    tables, lens = decodes([(3, [1, 15, 16, 40]), (0, [9])], 16)
    query, k_cache, v_cache, meta = flat_batch([1] * 5, lens, tables, 9, 3, 64, 16, num_blocks=64, seed=8)
    query, k_cache, v_cache = query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    ops = TorchOps()
    ops._paged = vector
    got = ops.attention(query, k_cache, v_cache, meta, 0.125)
    assert_within_bfloat16_weights(got, query, k_cache, v_cache, meta, 0.125)


# In 64-token blocks: a set of 7 decodes over 3 shared blocks (21 rows at 3 query heads per KV head: the row-vectorized
# walk), a set of 2 over 1, two lone decodes, one of them 130 tokens long
SLICED_GROUPS = [(3, [1, 15, 16, 40, 2, 17, 70]), (1, [9, 64]), (0, [5]), (0, [130])]


@pytest.mark.parametrize(("pool", "query_dtype", "options", "window"), [
    (torch.float32, torch.float32, {}, None), (torch.bfloat16, torch.bfloat16, {}, None),
    (torch.float8_e4m3fn, torch.bfloat16, {}, None), (torch.float32, torch.float32, {"batch_invariant": True}, 90)],
    ids=["float32", "bfloat16", "e4m3", "batch-invariant-window-90"])
def test_a_pool_of_64_token_blocks_walks_as_16_token_slices_with_the_bits_of_16_token_blocks(
        kernel, pool, query_dtype, options, window):
    # block b of 64 tokens is slices 4b to 4b + 3 of the same memory viewed in blocks of 16; walked whole, a bigger
    # block's buffers outgrew the L1 cache (blocks of 32-128 took 1.06-1.35x the time of their slices). Under the
    # window rows start inside a block: the 262-token decode skips 44 tokens of its block at 172, two whole slices and
    # 12 tokens of the third
    tables, lens = decodes(SLICED_GROUPS, 64)
    q_lens = [1] * len(lens)
    query, k_cache, v_cache, meta = flat_batch(q_lens, lens, tables, 9, 3, 64, 64,
                                               num_blocks=max(map(max, tables)) + 1, seed=3)
    query, k_cache, v_cache = query.to(query_dtype), k_cache.to(pool), v_cache.to(pool)
    slices = [[4 * b + j for b in table for j in range(4)][: cdiv(length, 16)] for table, length in zip(tables, lens)]
    sliced_meta = flat_batch(q_lens, lens, slices, 9, 3, 64, 16, num_blocks=1)[3]
    ops = TorchOps(**options)
    got = ops.attention(query, k_cache, v_cache, meta, 0.125, window)
    want = ops.attention(query, k_cache.view(-1, 16, 3, 64), v_cache.view(-1, 16, 3, 64), sliced_meta, 0.125, window)
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 100), min_size=1, max_size=8)),
                       min_size=1, max_size=3),
       block=st.sampled_from([4, 8, 16, 24, 32, 64]), dim=st.sampled_from([64, 128]), per_kv=st.sampled_from([1, 3, 7]),
       pool=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]), seed=st.integers(0, 99))
def test_bfloat16_decodes_over_any_block_size_and_pool_stay_within_the_bfloat16_weights_bound(
        groups, block, dim, per_kv, pool, seed):
    # every walk a bfloat16 model's decodes take (the row-vectorized shared walk from 16 rows, the rows' own walks,
    # 16-token slices of blocks of 32 and 64, blocks smaller than a slice) over every pool it reads with pair
    # products. A block of 24 is walked whole, 16 tokens and then 8: the bug session 48 fixed (the values after a
    # block's first 16 tokens read 16 pairs too far) fails here at block 24
    tables, lens = decodes(groups, block)
    query, k_cache, v_cache, meta = flat_batch([1] * len(lens), lens, tables, 2 * per_kv, 2, dim, block,
                                               num_blocks=max(map(max, tables)) + 1, seed=seed)
    query, k_cache, v_cache = query.bfloat16(), k_cache.to(pool), v_cache.to(pool)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 0.125)
    assert_within_bfloat16_weights(got, query, k_cache, v_cache, meta, 0.125)


def test_a_bfloat16_model_gets_its_decode_rows_back_in_bfloat16(kernel):
    # a step with a chunk beside the decodes: the kernel writes the decode rows, the chunk's rows (nothing cached
    # before them) stay the torch path's; a float32 scratch output is copied back to the model's dtype
    tables, lens = decodes([(2, [3, 9])], 4)
    tables.append([40])
    query, k_cache, v_cache, meta = flat_batch([1, 1, 3], [*lens, 3], tables, num_blocks=64, seed=6)
    query = query.to(torch.bfloat16)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 0.25)
    want = TorchOps(native=False).attention(query, k_cache, v_cache, meta, 0.25)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), atol=1e-2)


def chunk_step(groups: list[tuple[int, list[tuple[int, int]]]], decode_lens: list[int], heads: int, kv_heads: int,
               dim: int, block: int, seed: int, dtype=torch.float32):
    """A step of prefill chunks after cached keys, and lone decodes: each group (shared blocks, members) has members
    (own cached tokens, queries), so (3, [(2, 10)]) is a chunk of 10 queries after 3 shared blocks and 2 more tokens.
    Block ids distinct and scattered, as in `decodes`."""
    tables, q_lens, seq_lens, next_block = [], [], [], 0
    for shared, members in groups:
        prefix = list(range(next_block, next_block + shared))
        next_block += shared
        for cached, queries in members:
            count = cdiv(cached + queries, block)
            tables.append(prefix + list(range(next_block, next_block + count)))
            next_block += count
            q_lens.append(queries)
            seq_lens.append(shared * block + cached + queries)
    for length in decode_lens:
        tables.append(list(range(next_block, next_block + cdiv(length, block))))
        next_block += cdiv(length, block)
        q_lens.append(1)
        seq_lens.append(length)
    scatter = torch.randperm(next_block + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [[scatter[b] for b in table] for table in tables]
    query, k_cache, v_cache, meta = flat_batch(q_lens, seq_lens, tables, heads, kv_heads, dim, block,
                                               num_blocks=next_block + 3, seed=seed)
    query, k_cache, v_cache = query.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    ops = TorchOps()
    planned = ops.plan(meta, k_cache, heads, query.dtype)
    got = ops.attention(query, k_cache, v_cache, planned, 0.125).float()
    # the reference: padded group calls or one fused call per chunk, on the same values in float32
    want = TorchOps(native=False).attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    return got, want, planned.plan


def test_best_of_4_responses_after_one_prompt_read_it_once_in_one_set_of_40_rows(kernel):
    # a 50-token prompt at 16-token blocks (3 whole blocks, then 2 tokens each response holds a copy of) and 4
    # responses of 10 tokens: the vector walks read the 48 shared tokens once for all 40 rows (3 query heads
    # each), then each row its own 3 to 12 tokens
    got, want, plan = chunk_step([(3, [(2, 10)] * 4)], [], 9, 3, 64, 16, seed=1)
    assert plan.batches == [] and plan.alone == []  # no padded group call is left
    assert plan.decodes.sets[:, 1:].tolist() == [[40, 48]]
    assert sorted(plan.decodes.own_lens.tolist()) == sorted(list(range(3, 13)) * 4)
    assert torch.allclose(got, want, atol=1e-5)


def test_in_tile_walks_each_response_walks_from_0_with_each_lane_stopping_at_its_row(kernel):
    # the same step in bfloat16 (tile walks where the CPU has AMX, else vector walks): laid out for the tiles, a
    # response's 10 rows walk its 60 keys from position 0 as one set, lanes limited to 51..60 keys, so no row
    # walks alone
    got, want, plan = chunk_step([(3, [(2, 10)] * 4)], [], 9, 3, 64, 16, seed=1, dtype=torch.bfloat16)
    assert float((got - want).abs().max()) < TILE_TOLERANCE
    tables = [[4 * i + b for b in range(4)] for i in range(4)]
    meta = flat_batch([10] * 4, [60] * 4, tables, 9, 3, 64, 16)[3]
    tiled = kernel.plan(meta, [], [0, 1, 2, 3], tables, 16, 3, tiles=True)
    assert tiled.sets[:, 1:].tolist() == [[10, 60]] * 4
    assert tiled.own_lens.tolist() == [0] * 40
    assert sorted(tiled.lane_lengths.tolist()) == sorted(list(range(51, 61)) * 4)


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_every_prefill_chunk_walks_the_pool_and_equals_the_fused_calls(kernel, pool):
    # a 300-token prompt from scratch (90,000 query-key pairs: too many for group attention's dense mask, so it ran
    # alone in torch's fused kernel), a 40-token one (group attention), 200 tokens after 40 cached (48,000 pairs,
    # walked before too), and a decode: where the vector walks run, all of them are the kernel's rows, in runs of
    # 96 query rows (32 tokens at 3 query heads a KV head), and no fused call is left
    query_dtype = torch.float32 if pool == torch.float32 else torch.bfloat16
    tables, q_lens, seq_lens = [list(range(0, 19)), [19, 20, 21], list(range(22, 37)), [37, 38]], [300, 40, 200, 1], \
        [300, 40, 240, 20]
    query, k_cache, v_cache, meta = flat_batch(q_lens, seq_lens, tables, 9, 3, 64, 16, num_blocks=40, seed=2)
    query, k_cache, v_cache = query.to(query_dtype), k_cache.to(pool), v_cache.to(pool)
    ops = TorchOps()
    planned = ops.plan(meta, k_cache, 9, query.dtype)
    if pool == torch.bfloat16 and kernel.uses_tiles(16, 64):  # AMX: the tile walks keep the fused routes (below):
        # the 300-token prompt alone, the 40-token one grouped, the 200 after 40 cached (48,000 pairs) walked
        assert planned.plan.alone == [0] and len(planned.plan.batches) == 1
    else:
        assert planned.plan.batches == [] and planned.plan.alone == []
        assert planned.plan.decodes.rows.shape[0] == sum(q_lens)  # every query row of the step
        # runs of 32 tokens: nine and a 12 of the 300, one and an 8 of the 40, six and an 8 of the 200; the two
        # fresh prompts' first runs read no prefix, so they share one set of 64 (MAX_CHUNK_SET_ROWS // 3)
        assert paged_decode.CHUNK_RUN_ROWS // 3 == 32
        assert sorted(planned.plan.decodes.sets[:, 1].tolist()) == [1, 8, 8, 12] + [32] * 14 + [64]
    got = ops.attention(query, k_cache, v_cache, planned, 0.125).float()
    want = TorchOps(native=False).attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    # float32: the same sums in another order; bfloat16 outputs: their rounding (values below 5: 2^-6 apart there)
    assert float((got - want).abs().max()) < (1e-5 if pool == torch.float32 else TILE_TOLERANCE)


def test_beside_the_tile_walks_chunks_keep_the_fused_routes():
    # routes by (queries, context): short after a whole cached block -> walked; short from scratch -> grouped;
    # over GROUPED_MAX_PAIRS (65,536) query-key pairs -> alone. Where the vector walks run, every chunk walks.
    q_lens, seq_lens = [1, 20, 20, 300, 300], [30, 40, 20, 300, 340]
    meta = flat_batch(q_lens, seq_lens, [[0, 1, 2]] * 5, block=16)[3]
    assert _route_chunks(meta, 16, paged=True, tiles=True) == ([1], [2], [3, 4])
    assert _route_chunks(meta, 16, paged=False, tiles=False) == ([], [1, 2], [3, 4])
    assert _route_chunks(meta, 16, paged=True, tiles=False) == ([1, 2, 3, 4], [], [])


chunk_groups = st.lists(st.tuples(st.integers(0, 5), st.lists(st.tuples(st.integers(0, 40), st.integers(2, 90)),
                                                                min_size=1, max_size=4)), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(groups=chunk_groups, decode_lens=st.lists(st.integers(1, 60), max_size=3), per_kv=st.sampled_from([1, 3, 4]),
       seed=st.integers(0, 99))
def test_chunks_after_cached_keys_beside_decodes_equal_the_fused_calls(groups, decode_lens, per_kv, seed):
    got, want, _ = chunk_step(groups, decode_lens, 2 * per_kv, 2, 16, 8, seed)
    assert torch.allclose(got, want, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(groups=chunk_groups, decode_lens=st.lists(st.integers(1, 200), max_size=3), per_kv=st.sampled_from([1, 3, 7]),
       seed=st.integers(0, 99))
def test_chunks_after_cached_keys_in_bfloat16_equal_the_fused_calls_within_the_weights_rounding(groups, decode_lens,
                                                                                                 per_kv, seed):
    got, want, _ = chunk_step(groups, decode_lens, 2 * per_kv, 2, 64, 16, seed, dtype=torch.bfloat16)
    assert float((got - want).abs().max()) < TILE_TOLERANCE


@pytest.mark.parametrize("switched_off", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma"]],
                         ids=["avx2", "plain"])
def test_the_builds_for_a_cpu_without_avx512_or_avx2_give_the_same_attention(tmp_path, switched_off):
    # built here with AVX-512 switched off (the AVX2 walks, as -march=native makes them on an AMD Zen 3), and with
    # AVX2 off too (the plain loops); one failed to compile once. 6 decodes over 3 shared blocks are 18 rows, so the
    # set walks its prefix vectorized across rows where the build has vector walks
    library = tmp_path / "build.so"
    subprocess.run([os.environ.get("CXX") or "c++", *native.FLAGS, *switched_off, "-o", str(library),
                    str(native.SOURCES / "paged_decode.cpp")], check=True, capture_output=True)
    tables, lens = decodes([(3, [1, 15, 16, 40, 2, 17]), (0, [9])], 16)
    query, k_cache, v_cache, meta = flat_batch([1] * 7, lens, tables, 9, 3, 64, 16, num_blocks=64, seed=8)
    plain = TorchOps()
    plain._paged = paged_decode.PagedDecode(ctypes.CDLL(str(library)))
    got = plain.attention(query, k_cache, v_cache, meta, 0.125)
    assert torch.allclose(got, TorchOps(native=False).attention(query, k_cache, v_cache, meta, 0.125), atol=1e-5)


def test_without_the_kernel_decodes_are_gathered():
    tables, lens = decodes([(2, [3, 9])], 4)
    query, k_cache, v_cache, meta = flat_batch([1, 1], lens, tables, num_blocks=64)
    assert isinstance(TorchOps(native=False).plan(meta, k_cache, 6, query.dtype).plan.decodes, DecodePlan)
    # a KV dtype the kernel lacks is gathered too
    assert isinstance(TorchOps().plan(meta, k_cache.half(), 6, query.dtype).plan.decodes, DecodePlan)


def test_the_library_is_built_once_per_source_and_cpu_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = os.environ.get("CXX") or "c++"
    first = native.built(native.SOURCES / "paged_decode.cpp", compiler)
    assert first.parent == tmp_path / "batchprefill" / "kernels" and first.exists()
    built_at = first.stat().st_mtime_ns
    assert native.built(native.SOURCES / "paged_decode.cpp", compiler) == first and first.stat().st_mtime_ns == built_at
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging file left behind
