"""The C++ decode kernel reads the paged pool in place and gives what gathering each context gives."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.kernels import native, paged_decode
from batchprefill.kernels.decode_groups import gathered
from batchprefill.kernels.torch_ops import TorchOps
from tests.test_prefix_groups import flat_batch


@pytest.fixture(scope="module")
def kernel() -> paged_decode.PagedDecode:
    built = paged_decode.load()
    assert built is not None, "the decode kernel must build here (a C++ compiler is on this machine)"
    return built


def items(lens: list[int], kv_heads: int, rows: int, dim: int, block: int, seed: int, dtype=torch.float32):
    """Query sets over random, scattered blocks of one pool, with each item's padding mask for the gathered path."""
    generator = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // block) for n in lens))
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=generator).to(dtype)
    blocks = torch.randperm(num_blocks, generator=generator)[: len(lens) * width].view(len(lens), width)
    query = torch.randn(len(lens), kv_heads, rows, dim, generator=generator)
    visible = torch.arange(width * block)[None, :] < torch.tensor(lens)[:, None]
    mask = torch.zeros(len(lens), 1, 1, width * block).masked_fill_(~visible[:, None, None, :], float("-inf"))
    return query, k_cache, v_cache, blocks.long(), mask, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize(("rows", "dim", "block"),
                         [(3, 64, 16), (9, 64, 16), (5, 128, 32), (27, 64, 16), (16, 128, 16), (3, 40, 16), (1, 8, 4)])
def test_in_place_attention_equals_the_gathered_copy_for_lengths_around_block_edges(kernel, rows, dim, block):
    # lengths 1, a block minus one, exactly one and two blocks, a block plus one, and a longer context; heads of
    # 64 and 128 take the AVX-512 path where the CPU has it, 40 and 8 the plain one; 9 and 5 rows leave a
    # remainder after rows are taken four at a time; 16 and 27 rows (a group of decodes over its shared prefix)
    # run vectorized across rows, 27 padded to 32
    lens = [1, block - 1, block, 2 * block, block + 1, 7 * block + 3]
    query, k_cache, v_cache, blocks, mask, lengths = items(lens, 2, rows, dim, block, seed=rows + dim)
    want, want_lse = gathered(query, k_cache, v_cache, blocks, mask, lengths, 0.125)
    got, got_lse = kernel.attend(query, k_cache, v_cache, blocks, lengths, 0.125)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_lse, want_lse.float(), atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=6), rows=st.integers(1, 20), seed=st.integers(0, 99))
def test_in_place_attention_equals_the_gathered_copy_for_any_lengths(kernel, lens, rows, seed):
    query, k_cache, v_cache, blocks, mask, lengths = items(lens, 3, rows, 16, 8, seed)
    want, want_lse = gathered(query, k_cache, v_cache, blocks, mask, lengths, 0.3)
    got, got_lse = kernel.attend(query, k_cache, v_cache, blocks, lengths, 0.3)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_lse, want_lse.float(), atol=1e-5)


def test_a_bfloat16_pool_is_widened_exactly_before_the_float32_arithmetic(kernel):
    lens = [5, 16, 33]
    query, k_cache, v_cache, blocks, mask, lengths = items(lens, 2, 3, 64, 16, seed=4, dtype=torch.bfloat16)
    # the gathered path on the same values widened to float32 is the exact reference
    want, want_lse = gathered(query, k_cache.float(), v_cache.float(), blocks, mask, lengths, 0.125)
    got, got_lse = kernel.attend(query, k_cache, v_cache, blocks, lengths, 0.125)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_lse, want_lse, atol=1e-5)


def test_an_item_that_reads_no_token_gets_zeros_and_minus_infinity(kernel):
    query, k_cache, v_cache, blocks, _, _ = items([4, 4], 2, 3, 16, 4, seed=5)
    got, got_lse = kernel.attend(query, k_cache, v_cache, blocks, torch.tensor([0, 4]), 0.5)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and bool(torch.isneginf(got_lse[0]).all())
    assert bool(torch.isfinite(got_lse[1]).all())


def test_the_torch_path_gives_the_same_decode_attention_with_and_without_the_kernel(kernel):
    shared = [3, 4, 5]
    tables = [shared + [20, 21], shared + [22], shared + [23, 24, 25], [30, 31]]
    query, k_cache, v_cache, meta = flat_batch([1, 1, 1, 1], [19, 14, 23, 7], tables, seed=21)
    native, plain = TorchOps(), TorchOps(native=False)
    assert plain._attend is gathered and native._attend is not gathered
    got = native.attention(query, k_cache, v_cache, meta, 0.25)
    assert torch.allclose(got, plain.attention(query, k_cache, v_cache, meta, 0.25), atol=1e-5)


def test_the_library_is_built_once_per_source_and_cpu_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = os.environ.get("CXX") or "c++"
    first = native.built(native.SOURCES / "paged_decode.cpp", compiler)
    assert first.parent == tmp_path / "batchprefill" / "kernels" and first.exists()
    built_at = first.stat().st_mtime_ns
    assert native.built(native.SOURCES / "paged_decode.cpp", compiler) == first and first.stat().st_mtime_ns == built_at
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging file left behind
