"""Shared-prefix group attention on the torch path: sequences that share prefix blocks give what each alone gives."""

import functools

import torch

from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.torch.ops import GROUPED_MAX_PAIRS, TorchOps
from batchprefill.kernels.torch.prefix_groups import PADDING_BUDGET, batch_groups, find_groups

# The routes under test: without the C++ kernel every chunk goes to group attention or alone (with it, chunks walk the
# pool: tests/test_paged_decode.py).
GROUPING = functools.partial(TorchOps, native=False)


def flat_batch(q_lens, seq_lens, tables, heads=6, kv_heads=2, dim=16, block=4, num_blocks=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32), padded,
                             torch.zeros(sum(q_lens), dtype=torch.int64), list(q_lens), list(seq_lens))
    query = torch.randn(sum(q_lens), heads, dim, generator=generator)
    return query, k_cache, v_cache, meta


def one_by_one(query, k_cache, v_cache, meta, scale):
    ops, out = TorchOps(), torch.full_like(query, float("nan"))
    for s in range(meta.num_seqs):
        ops._one_sequence(query, k_cache, v_cache, meta, scale, s, out)
    return out


def test_groups_are_the_deepest_prefix_shared_and_match_each_sequence_alone():
    shared_a, shared_b = [10, 11, 12], [20, 21]
    tables = [shared_a + [30, 31], shared_a + [32], shared_a + [33, 34, 35], shared_b + [40], shared_b + [41, 42],
              [50, 51, 52], shared_a[:2] + [60, 61]]
    seq_lens = [18, 15, 23, 10, 19, 11, 13]  # ends mid-block; the last shares only two blocks of group a
    q_lens = [1, 1, 1, 1, 1, 1, 1]
    query, k_cache, v_cache, meta = flat_batch(q_lens, seq_lens, tables)
    groups = find_groups(meta, list(range(7)), tables, 4)
    # all of group a, both blocks of group b; the last sequence shares two of a's blocks with nobody else at
    # that depth, so it stands alone, as does the sequence that shares nothing
    assert sorted((g.members, g.keys[: g.shared]) for g in groups) == [
        ([0, 1, 2], shared_a), ([3, 4], shared_b), ([5], []), ([6], [])]
    group_a = next(g for g in groups if g.members == [0, 1, 2])
    assert group_a.keys == shared_a + [30, 31, 32, 33, 34, 35]  # the shared blocks once, then each member's own
    got = GROUPING().attention(query, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_a_query_inside_a_shared_block_never_counts_it_as_shared():
    tables = [[7, 8, 9], [7, 8, 9]]  # same physical blocks, but one sequence is still prefilling block 8
    query, k_cache, v_cache, meta = flat_batch([6, 1], [10, 12], tables)
    assert [g.keys[: g.shared] for g in find_groups(meta, [0, 1], tables, 4)] == [[7]]
    got = GROUPING().attention(query, k_cache, v_cache, meta, 0.3)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.3), atol=1e-5)


def test_a_mixed_batch_of_decodes_short_and_long_chunks_matches_each_sequence_alone():
    shared = [3, 4, 5]
    tables = [shared + [20], shared + [21], shared + [22, 23], [30, 31, 32], shared + [24], shared + [25, 26],
              [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]]
    q_lens = [1, 1, 9, 12, 1, 7, 70]
    seq_lens = [13, 14, 20, 12, 16, 19, 75]
    query, k_cache, v_cache, meta = flat_batch(q_lens, seq_lens, tables, seed=3)
    ops = GROUPING()
    meta = ops.plan(meta, k_cache, query.shape[1], query.dtype)
    assert meta.plan.alone == []  # all short enough to group
    got = ops.attention(query, k_cache, v_cache, meta, 0.2)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.2), atol=1e-5)


def test_chunks_too_long_for_a_dense_mask_run_alone(monkeypatch):
    monkeypatch.setattr("batchprefill.kernels.torch.ops.GROUPED_MAX_PAIRS", 70 * 75 - 1)
    assert GROUPED_MAX_PAIRS > 70 * 75  # the real limit groups this chunk; the lowered one does not
    tables = [[3, 4, 5, 20], list(range(40, 59))]
    query, k_cache, v_cache, meta = flat_batch([1, 70], [13, 75], tables, seed=4)
    ops = GROUPING()
    meta = ops.plan(meta, k_cache, query.shape[1], query.dtype)
    assert meta.plan.alone == [1]
    got = ops.attention(query, k_cache, v_cache, meta, 0.2)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.2), atol=1e-5)


def test_groups_of_very_different_sizes_go_to_separate_batches_within_the_padding_budget():
    # one group of eight decodes on a long shared prefix, and four lone decodes with short contexts
    prefix = list(range(1, 11))
    tables = [prefix + [20 + i] for i in range(8)] + [[40 + i] for i in range(4)]
    seq_lens = [41 + i % 4 for i in range(8)] + [2, 3, 4, 3]
    query, k_cache, v_cache, meta = flat_batch([1] * 12, seq_lens, tables, seed=5)
    batches = batch_groups(find_groups(meta, list(range(12)), tables, 4), meta)
    assert len(batches) == 2
    for batch in batches:
        real = sum(len(g.members) * len(g.keys) for g in batch)
        padded = len(batch) * max(len(g.members) for g in batch) * max(len(g.keys) for g in batch)
        assert padded <= PADDING_BUDGET * real
    got = GROUPING().attention(query, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_half_precision_queries_and_cache_stay_close_to_float32():
    shared = [3, 4, 5]
    tables = [shared + [20], shared + [21], shared + [22, 23]]
    query, k_cache, v_cache, meta = flat_batch([1, 1, 6], [13, 14, 20], tables, seed=7)
    reference = one_by_one(query, k_cache, v_cache, meta, 0.25)
    got = GROUPING().attention(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.25)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), reference, atol=3e-2, rtol=3e-2)


def test_long_chunks_over_a_short_shared_prefix_stay_apart():
    # one shared block, then 12 own blocks each: grouping would have every query scan its partners' blocks
    tables = [[1] + list(range(10 + 20 * i, 22 + 20 * i)) for i in range(3)]
    query, k_cache, v_cache, meta = flat_batch([40, 40, 40], [52, 52, 52], tables, seed=6)
    groups = find_groups(meta, [0, 1, 2], tables, 4)
    assert [g.members for g in groups] == [[0], [1], [2]] and all(g.shared == 0 for g in groups)
    got = GROUPING().attention(query, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_a_batch_gathers_at_most_the_key_block_budget(monkeypatch):
    monkeypatch.setattr("batchprefill.kernels.torch.prefix_groups.MAX_BATCH_KEY_BLOCKS", 8)
    tables = [[10 + 3 * i, 11 + 3 * i, 12 + 3 * i] for i in range(5)]  # five lone decodes of three blocks each
    query, k_cache, v_cache, meta = flat_batch([1] * 5, [10, 11, 12, 10, 9], tables, seed=8)
    batches = batch_groups(find_groups(meta, list(range(5)), tables, 4), meta)
    assert [len(batch) for batch in batches] == [2, 2, 1]  # 2 x 3 blocks fit in 8, 3 x 3 do not
    got = GROUPING().attention(query, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_a_long_chunk_after_a_cached_prefix_splits_and_matches_the_masked_call(monkeypatch):
    monkeypatch.setattr("batchprefill.kernels.torch.ops.SPLIT_CAUSAL_QUERIES", 16)
    tables = [list(range(10, 20))]
    query, k_cache, v_cache, meta = flat_batch([22], [37], tables, seed=9)  # 15 cached tokens, 22 new
    split = torch.full_like(query, float("nan"))
    TorchOps()._one_sequence(query, k_cache, v_cache, meta, 0.25, 0, split)
    monkeypatch.setattr("batchprefill.kernels.torch.ops.SPLIT_CAUSAL_QUERIES", 10_000)
    masked = torch.full_like(query, float("nan"))
    TorchOps()._one_sequence(query, k_cache, v_cache, meta, 0.25, 0, masked)
    assert torch.allclose(split, masked, atol=1e-5)
    # and against the definition: query j at position 15 + j sees keys 0..15 + j
    keys = k_cache[10:20].flatten(0, 1)[:37].repeat_interleave(3, 1)
    values = v_cache[10:20].flatten(0, 1)[:37].repeat_interleave(3, 1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * 0.25
    hidden = torch.arange(37)[None, None, :] > (15 + torch.arange(22))[None, :, None]
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values)
    assert torch.allclose(split, expected, atol=1e-5)
