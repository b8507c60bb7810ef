"""The shared-prefix decode (kernels/triton/shared_decode.py) against the torch reference, under the interpreter, and
the grouping it plans from the host block tables (kernels/shared_prefix.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.engine.decode_graphs import PaddedDecode, group_layout
from batchprefill.kernels.shared_prefix import group_decodes
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.kernels.triton.ops import TritonOps
from tests.synthetic import random_paged_batch, tiny_llama, unpadded_decode
from tests.test_kernels import TOL, assert_close, poisoned_allocations  # noqa: F401 (an autouse fixture)


def grouped_batch(specs: list[tuple[int, int]], groups: list[tuple[list[int], int]], q_heads: int, kv_heads: int,
                  head_dim: int, block: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """`random_paged_batch` of (context, queries) `specs` where each group (sequences, blocks) has its sequences
    point at the first one's leading `blocks` blocks, and the host copy of the tables the engine passes."""
    query, k_cache, v_cache, meta = random_paged_batch(specs, q_heads, kv_heads, head_dim, block, dtype, seed=seed)
    tables = meta.block_tables.clone()
    for members, blocks in groups:
        tables[members[1:], :blocks] = tables[members[0], :blocks].clone()
    meta.block_tables = tables
    meta.block_tables_host = tables.numpy()
    return query, k_cache, v_cache, meta


def check_against_torch(ops: TritonOps, query, k_cache, v_cache, meta, dtype=torch.float32, window=None) -> None:
    scale = query.shape[2] ** -0.5
    want = TorchOps().attention(query, k_cache, v_cache, meta, scale, window)
    assert_close(ops.attention(query, k_cache, v_cache, meta, scale, window), want, dtype)


# Block 8. Group A: sequences 0, 1, 2 over 4 shared blocks (32 tokens), sequence 2's context exactly those 32
# tokens (its shared length is its whole context minus its own token). Group B: sequences 4-10 over 2 blocks, 7
# members cut into sub-groups of at most 4 (16 rows at GQA 4:1) or 5 (16 rows at 3:1). Sequences 3 and 11: alone.
SPECS = [(45, 1), (39, 1), (32, 1), (50, 1), *[(17 + 3 * i, 1) for i in range(7)], (9, 1)]
GROUPS = [([0, 1, 2], 4), (list(range(4, 11)), 2)]


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "dtype"), [
    (8, 2, 64, torch.float32), (6, 2, 80, torch.float32), (8, 2, 64, torch.bfloat16)],
    ids=["gqa4-d64", "gqa3-d80", "gqa4-bf16"])
def test_two_groups_of_3_and_7_decodes_and_two_lone_ones_match_torch_with_the_merge_fused_into_the_decode(
        q_heads, kv_heads, head_dim, dtype) -> None:
    """12 rows x 2 KV heads fill the 16 programs: own contexts unsplit, so the decode kernel merges each row's
    prefix slots itself; the two lone rows (shared length 0) must read none of theirs (poisoned memory)."""
    query, k_cache, v_cache, meta = grouped_batch(SPECS, GROUPS, q_heads, kv_heads, head_dim, 8, dtype)
    ops = TritonOps(block_n=16, decode_min_segment=16, shared_rows=16)
    plan = ops.plan(meta, k_cache, q_heads, dtype).plan
    assert plan.num_segments == 1
    groups = plan.decode_groups
    members_per_group = groups.groups[:, 1].tolist()
    assert members_per_group == [3, 4, 3]  # group A first (the longer prefix), then B in two
    assert groups.shared_lens.tolist() == [32, 32, 32, 0, *[16] * 7, 0]
    check_against_torch(ops, query, k_cache, v_cache, meta, dtype)


@pytest.mark.parametrize(("target_programs", "own_segments"), [(12, 3), (4, 1)],
                         ids=["split-own-merge-kernel", "unsplit-own-fused-merge"])
def test_a_group_of_4_decodes_reads_its_48_shared_tokens_in_3_segments_each_merged_with_its_own(
        target_programs: int, own_segments: int) -> None:
    """Prefix split into segments of 16 tokens on the device (3 slots). With 12 programs wanted, own contexts of
    1-20 tokens split in one or two of 3 segments each and the merge kernel takes every slot kind in one pass;
    with 4, the own contexts are unsplit and the decode kernel merges the 3 prefix slots itself."""
    specs = [(48, 1), (55, 1), (68, 1), (50, 1)]
    query, k_cache, v_cache, meta = grouped_batch(specs, [([0, 1, 2, 3], 6)], 4, 1, 32, 8)
    ops = TritonOps(block_n=16, decode_min_segment=16, decode_target_programs=target_programs)
    plan = ops.plan(meta, k_cache, 4, torch.float32).plan
    assert (plan.prefix_segments, plan.num_segments) == (3, own_segments)
    assert plan.decode_groups.shared_lens.tolist() == [48] * 4
    check_against_torch(ops, query, k_cache, v_cache, meta)


def test_a_mixed_step_groups_its_decodes_and_tiles_its_chunks() -> None:
    """Chunks (sequences 0 and 3) beside decodes 1, 2, 4 (1 and 4 grouped, 2 alone): the group is addressed by
    launch rows 0 and 2, its table through sequence 1."""
    specs = [(20, 30), (40, 1), (25, 1), (0, 17), (35, 1)]
    query, k_cache, v_cache, meta = grouped_batch(specs, [([1, 4], 4)], 6, 2, 32, 8, seed=3)
    ops = TritonOps(block_m=16, block_n=16, decode_min_segment=16)
    plan = ops.plan(meta, k_cache, 6, torch.float32).plan
    assert (plan.decode_rows.tolist(), plan.num_segments) == ([1, 2, 4], 3)  # own contexts split
    assert plan.decode_groups.groups.tolist() == [[0, 2, 32, 1]] and plan.decode_groups.members.tolist() == [0, 2]
    check_against_torch(ops, query, k_cache, v_cache, meta)


def test_under_a_sliding_window_a_grouped_step_launches_the_plain_decode() -> None:
    query, k_cache, v_cache, meta = grouped_batch(SPECS[:3], GROUPS[:1], 4, 2, 32, 8)
    ops = TritonOps(block_n=16, decode_min_segment=16)
    assert ops.plan(meta, k_cache, 4, torch.float32).plan.decode_groups is not None
    check_against_torch(ops, query, k_cache, v_cache, meta, window=20)


def test_no_group_and_batch_invariant_steps_plan_no_groups() -> None:
    query, k_cache, v_cache, meta = grouped_batch([(40, 1), (30, 1)], [], 4, 2, 32, 8)
    assert TritonOps().plan(meta, k_cache, 4, torch.float32).plan.decode_groups is None
    query, k_cache, v_cache, meta = grouped_batch(SPECS[:3], GROUPS[:1], 4, 2, 32, 8)
    invariant = TritonOps(batch_invariant=True)
    assert invariant.plan(meta, k_cache, 4, torch.float32).plan.decode_groups is None
    assert invariant.group_decodes(np.array([33, 33]), np.zeros((2, 5), dtype=np.int32), 8, 4) is None


def test_grouping_keys_on_the_deepest_shared_blocks_and_leaves_the_block_being_written_own() -> None:
    """Rows 0-2 share blocks 5, 6 (row 2 also 7 with row 3: its deepest prefix is 5, 6, 7); row 4 shares nothing.
    Row 3's context ends exactly after block 7, but its query writes block 8: all 3 full blocks are shareable."""
    tables = np.array([[5, 6, 1, 0], [5, 6, 2, 0], [5, 6, 7, 3], [5, 6, 7, 8], [9, 10, 11, 0]], dtype=np.int32)
    seq_lens = np.array([20, 22, 30, 25, 24])  # block 8: rows 0, 1 have 2 full blocks before their query
    found = group_decodes(seq_lens, tables, np.arange(5) + 10, 8, max_members=4)
    assert found.groups.tolist() == [[0, 2, 24, 12], [2, 2, 16, 10]]  # the longer prefix first
    assert found.members.tolist() == [2, 3, 0, 1]
    assert found.shared_lens.tolist() == [16, 16, 24, 24, 0]


def test_a_group_of_9_with_4_member_sub_groups_is_cut_into_3_3_and_3() -> None:
    tables = np.tile(np.array([[1, 2, 3]], dtype=np.int32), (9, 1))
    tables[:, 2] = np.arange(9) + 10
    found = group_decodes(np.full(9, 20), tables, np.arange(9), 8, max_members=4)
    assert found.groups[:, :3].tolist() == [[0, 3, 16], [3, 3, 16], [6, 3, 16]]
    assert group_decodes(np.array([20, 20]), tables[[0, 1]] + np.array([[0, 9, 0]]), np.arange(2), 8, 4) is not None
    assert group_decodes(np.array([20, 20]), np.array([[1, 2, 3], [4, 5, 6]]), np.arange(2), 8, 4) is None


def test_tables_the_prefix_cache_would_not_build_still_group_by_whole_prefixes() -> None:
    """Rows 0, 2 hold blocks (1, 2), rows 1, 3 blocks (3, 2): the same depth and last shared block, two groups."""
    tables = np.array([[1, 2, 9], [3, 2, 8], [1, 2, 7], [3, 2, 6]], dtype=np.int32)
    found = group_decodes(np.full(4, 20), tables, np.arange(4), 8, max_members=4)
    assert sorted(found.members[g : g + n].tolist() for g, n, _, _ in found.groups.tolist()) == [[0, 2], [1, 3]]


@settings(max_examples=4, deadline=None, derandomize=True)
@given(layout=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 12)), min_size=1, max_size=3))
def test_any_layout_of_groups_matches_torch(layout: list[tuple[int, int, int]]) -> None:
    """Groups of (members, shared blocks, extra own tokens): member j of a group has context shared + extra + j
    tokens (block 8), so shared lengths, own lengths and group sizes all vary; groups of 1 are lone decodes."""
    specs, groups = [], []
    for members, blocks, extra in layout:
        rows = list(range(len(specs), len(specs) + members))
        specs += [(blocks * 8 + extra + j, 1) for j in range(members)]
        groups.append((rows, blocks))
    query, k_cache, v_cache, meta = grouped_batch(specs, groups, 4, 2, 16, 8, seed=len(specs))
    check_against_torch(TritonOps(block_n=16, decode_min_segment=16, shared_rows=8), query, k_cache, v_cache, meta)


def test_padded_decode_of_5_grouped_rows_in_a_batch_of_8_matches_the_unpadded_forward() -> None:
    """The fixed buffers a CUDA graph replays, with decode groups staged after the head: rows 0, 2, 3 share 2
    blocks, rows 1 and 4 one block; then a step with no group over the first one's leftovers."""
    device = torch.device("cpu")
    model = tiny_llama(TritonOps(block_n=16, decode_min_segment=16))
    gen = torch.Generator().manual_seed(8)
    caches = [(torch.randn(20, 8, 2, 16, generator=gen), torch.randn(20, 8, 2, 16, generator=gen))]
    decoder = PaddedDecode(model, caches, block_size=8, max_num_seqs=8, device=device, capture=False)
    steps = [([3, 9, 4, 1, 7], [20, 12, 17, 23, 9],
              [[7, 1, 2, 0], [3, 5, 0, 0], [7, 1, 6, 0], [7, 1, 8, 11], [3, 12, 0, 0]]),
             ([11, 2], [12, 3], [[10, 11, 0, 0], [13, 0, 0, 0]])]
    for step, (ids, positions, tables) in enumerate(steps):
        table = np.asarray(tables, dtype=np.int32)
        pos = np.asarray(positions)
        slots = table[np.arange(len(ids)), pos // 8].astype(np.int64) * 8 + pos % 8
        got = decoder.run(np.asarray(ids), pos, slots, pos + 1, table)
        size = next(s for s in decoder.sizes if s >= len(ids))  # 8, then 2 over the first step's staged words
        staged = decoder._groups(size)
        assert staged.groups.shape[0] == group_layout(size)[0] == size // 2
        assert all(part.data_ptr() % 16 == 0 for part in (staged.groups, staged.members, staged.shared_lens))
        expected_groups = [[0, 3, 16, 0], [3, 2, 8, 1]] if step == 0 else []
        assert staged.groups[: len(expected_groups)].tolist() == expected_groups
        assert (staged.groups[len(expected_groups) :] == 0).all()
        want = unpadded_decode(model, caches, ids, pos, table, slots)
        assert_close(got, want, torch.float32)


def test_group_counts_and_prefix_splits_that_change_every_step_are_not_specialized() -> None:
    from batchprefill.kernels.triton.attention import _decode_kernel, _merge_kernel
    from batchprefill.kernels.triton.shared_decode import _shared_prefix_kernel

    for kernel, names in ((_shared_prefix_kernel, {"stride_table", "min_segment", "num_slots"}),
                          (_decode_kernel, {"prefix_slots"}), (_merge_kernel, {"prefix_slots"})):
        declared = kernel.kwargs if hasattr(kernel, "kwargs") else vars(kernel)  # interpreter or compiler
        assert names <= set(declared["do_not_specialize"])
        assert names <= set(declared["do_not_specialize_on_alignment"])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_the_group_programs_widen_an_fp8_pool_as_every_kernel_does(kv_dtype) -> None:
    """The same 12 rows over an FP8 pool (engine.kv_cache_dtype=fp8): the prefix read once per group and each row's
    own blocks equal float32 attention over the widened pool."""
    from batchprefill.kernels.fp8_kv import to_cache

    query, k_cache, v_cache, meta = grouped_batch(SPECS, GROUPS, 8, 2, 64, 8)
    k_cache, v_cache = (to_cache(cache, kv_dtype) for cache in (k_cache, v_cache))
    ops = TritonOps(block_n=16, decode_min_segment=16, shared_rows=16)
    assert ops.plan(meta, k_cache, 8, torch.float32).plan.decode_groups is not None
    got = ops.attention(query, k_cache, v_cache, meta, 0.125)
    want = TorchOps(native=False).attention(query, k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
