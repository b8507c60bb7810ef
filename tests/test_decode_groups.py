"""Decode attention on the torch path (gathered, where the in-place kernel is not built): shared prefix once per
group, own blocks per decode, merged by LSE."""

import torch

from batchprefill.kernels.torch.ops import TorchOps
from tests.test_prefix_groups import flat_batch, one_by_one


def test_three_decodes_under_a_3_block_prefix_score_it_once_and_only_their_own_blocks_after():
    shared = [3, 4, 5]
    tables = [shared + [20, 21], shared + [22], shared + [23, 24, 25], [30, 31]]
    seq_lens = [19, 14, 23, 7]  # 12 shared tokens, then 7, 2 and 11 own; the last decode shares nothing
    query, k_cache, v_cache, meta = flat_batch([1, 1, 1, 1], seq_lens, tables, seed=11)
    ops = TorchOps(native=False)
    plan = ops.plan(meta, k_cache, query.shape[1], query.dtype).plan.decodes
    (batch,) = plan.shared
    assert batch.blocks.tolist() == [shared] and sorted(batch.decodes.tolist()) == [0, 1, 2]
    # own blocks start after the shared ones: 2, 1, 3 and 2 blocks, padded to 3
    assert plan.own_blocks.tolist() == [[20, 21, 0], [22, 0, 0], [23, 24, 25], [30, 31, 0]]
    visible = (plan.own_mask[:, 0, 0] == 0).sum(-1).tolist()
    assert visible == [7, 2, 11, 7]
    got = ops.attention(query, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_decodes_between_chunks_at_two_prefix_depths_match_each_sequence_alone():
    system, document = [1, 2], [6, 7]
    tables = [system + document + [40], system + document + [41], system + [50, 51], system + [52, 53],
              system + [60, 61, 62], [33, 34]]
    q_lens = [1, 1, 1, 1, 5, 3]
    seq_lens = [17, 18, 15, 16, 20, 8]
    query, k_cache, v_cache, meta = flat_batch(q_lens, seq_lens, tables, seed=12)
    ops = TorchOps(native=False)
    plan = ops.plan(meta, k_cache, query.shape[1], query.dtype).plan.decodes
    depths = sorted(batch.blocks.shape[1] for batch in plan.shared)
    assert sum(len(b.decodes) for b in plan.shared) == 4 and set(depths) <= {2, 4}
    got = ops.attention(query, k_cache, v_cache, meta, 0.3)
    assert torch.allclose(got, one_by_one(query, k_cache, v_cache, meta, 0.3), atol=1e-5)


def test_bfloat16_decode_groups_stay_close_to_float32():
    shared = [3, 4, 5]
    tables = [shared + [20], shared + [21], shared + [22, 23]]
    query, k_cache, v_cache, meta = flat_batch([1, 1, 1], [13, 14, 20], tables, seed=13)
    reference = one_by_one(query, k_cache, v_cache, meta, 0.25)
    got = TorchOps().attention(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.25)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), reference, atol=3e-2, rtol=3e-2)


def test_the_device_variant_of_the_fused_call_gives_the_cpu_kernels_output_and_log_sum_exp():
    """On a GPU the torch backend (the reference there) cannot call torch's CPU-only fused kernel: 2 items x 3 KV heads
    x 5 query rows over 40 keys, the last 8 masked off, give the same output and log-sum-exp both ways."""
    from batchprefill.kernels.torch.decode_groups import _flash, attention_with_lse

    gen = torch.Generator().manual_seed(3)
    q, keys, values = (torch.randn(2, 3, rows, 16, generator=gen) for rows in (5, 40, 40))
    mask = torch.zeros(2, 1, 1, 40)
    mask[..., 32:] = float("-inf")
    out, lse = attention_with_lse(q, keys, values, mask, 0.25)
    want_out, want_lse = _flash(q, keys, values, 0.0, False, attn_mask=mask, scale=0.25)
    assert lse.shape == want_lse.shape == (2, 3, 5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
