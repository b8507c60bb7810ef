"""Cascade attention on the torch path: sequences that share prefix blocks give what each alone gives."""

import torch

from batchprefill.kernels.ops import AttentionMetadata, TorchOps


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


def test_groups_sharing_blocks_match_each_sequence_alone():
    shared_a, shared_b = [10, 11, 12], [20, 21]
    tables = [shared_a + [30, 31], shared_a + [32], shared_a + [33, 34, 35], shared_b + [40], shared_b + [41, 42],
              [50, 51, 52], shared_a[:2] + [60, 61]]
    seq_lens = [18, 15, 23, 10, 19, 11, 13]  # ends mid-block; the last shares only two blocks of group a
    q_lens = [1, 1, 5, 1, 7, 1, 3]
    query, k_cache, v_cache, meta = flat_batch(q_lens, seq_lens, tables)
    ops = TorchOps()
    got = torch.full_like(query, float("nan"))
    ops._cascade(query, k_cache, v_cache, meta, 0.25, list(range(meta.num_seqs)), got)
    assert ops._plan.groups  # the cascade really ran with shared groups
    # the deepest prefix each sequence shares with another: all of group a, both blocks of group b; the
    # last sequence shares only two of a's blocks with nobody else at that depth, so it stands alone
    groups = sorted((members, shared) for members, shared in ops._plan.groups)
    assert groups == [([0, 1, 2], shared_a), ([3, 4], shared_b)]
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_a_query_inside_a_shared_block_never_counts_it_as_shared():
    tables = [[7, 8, 9], [7, 8, 9]]  # same physical blocks, but one sequence is still prefilling block 8
    query, k_cache, v_cache, meta = flat_batch([6, 1], [10, 12], tables)
    ops = TorchOps()
    got = torch.full_like(query, float("nan"))
    ops._cascade(query, k_cache, v_cache, meta, 0.3, [0, 1], got)
    assert [shared for _, shared in ops._plan.groups] == [[7]]
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.3), atol=1e-5)


def test_a_mixed_batch_of_decodes_and_chunks_matches_each_sequence_alone():
    shared = [3, 4, 5]
    tables = [shared + [20], shared + [21], shared + [22, 23], [30, 31, 32], shared + [24]]
    query, k_cache, v_cache, meta = flat_batch([1, 1, 9, 12, 1], [13, 14, 20, 12, 16], tables, seed=3)
    got = TorchOps().attention(query, k_cache, v_cache, meta, 0.2)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.2), atol=1e-5)
