"""The mixture-of-experts MLP against transformers' own sparse-MoE blocks, and the fused Triton kernel against
the torch grouped path (under the interpreter, from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchprefill.kernels.experts import ExpertWeights, torch_experts
from batchprefill.kernels.fp8 import Fp8Weight
from batchprefill.kernels.linear import Linear, onednn_packs
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.moe import SparseMoe, route


def _randomized(block: torch.nn.Module, seed: int) -> torch.nn.Module:
    """transformers leaves expert tensors uninitialised: fill every parameter with seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.2)
    return block.eval()


def _ours(block: torch.nn.Module, top_k: int, normalize: bool) -> SparseMoe:
    experts = ExpertWeights(block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone())
    return SparseMoe(block.gate.weight.detach().clone(), experts, top_k, normalize)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw-topk", "norm-topk"])
def test_qwen3_moe_block_with_8_experts_top_2_matches_transformers_on_37_tokens(normalize: bool) -> None:
    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=normalize)
    block = _randomized(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config), 1)
    hidden = torch.randn(1, 37, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = block(hidden)[0]
    got = _ours(block, 2, normalize)(hidden[0], TorchOps())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_mixtral_block_with_4_experts_top_2_matches_transformers_on_29_tokens() -> None:
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=40, num_local_experts=4,
                                        num_experts_per_tok=2)
    block = _randomized(transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config), 3)
    hidden = torch.randn(1, 29, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = block(hidden)[0]
    got = _ours(block, 2, True)(hidden[0], TorchOps())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_normalized_top_2_weights_equal_a_softmax_over_the_two_largest_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    weights, ids = route(logits, top_k=2, normalize=True)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), dim=-1))
    raw, _ = route(logits, top_k=2, normalize=False)
    assert float(raw.sum()) < 0.9  # without renormalising, the other experts' mass is left out


def test_each_expert_with_tokens_runs_once_over_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """10 tokens x top-2 over 4 experts, of which expert 2 gets none: 3 gate_up and 3 down matmuls in all."""
    gen = torch.Generator().manual_seed(5)
    experts = ExpertWeights(torch.randn(4, 12, 8, generator=gen), torch.randn(4, 8, 6, generator=gen))
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 1], [1, 3], [3, 0], [0, 1], [1, 3], [3, 0], [0, 3]])
    weights = torch.rand(10, 2, generator=gen)
    hidden = torch.randn(10, 8, generator=gen)
    reference = ExpertWeights(experts.gate_up.clone(), experts.down.clone())
    calls: list[int] = []
    call = Linear.__call__
    monkeypatch.setattr(Linear, "__call__", lambda self, x: calls.append(x.shape[0]) or call(self, x))
    got = torch_experts(hidden, experts, weights, ids)
    assert sorted(calls) == [6, 6, 7, 7, 7, 7]  # experts 0, 1, 3 take 7, 6, 7 rows; each runs two matmuls
    expected = torch.zeros_like(hidden)
    for t in range(10):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (reference.gate_up[e] @ hidden[t]).chunk(2)
            expected[t] += weights[t, k] * (reference.down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # bf16: interpreter casts truncate


def _random_step(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # Scaled by 1/sqrt(fan-in), as trained weights are, so outputs are of order 1 and the tolerance means the same
    experts = ExpertWeights((torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype),
                            (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = route(torch.randn(tokens, num_experts, generator=gen), top_k, normalize=False)
    return x, experts, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "hidden", "inter", "num_experts", "top_k"), [
    (37, 48, 40, 8, 2),  # ragged: no dimension a multiple of a tile
    (1, 32, 64, 4, 2),  # one decode token: all but two experts idle
    (20, 64, 32, 3, 3),  # every token in every expert
], ids=["37-tokens-8-experts", "1-token", "all-experts"])
def test_fused_triton_moe_matches_the_torch_grouped_path(tokens, hidden, inter, num_experts, top_k, dtype) -> None:
    from batchprefill.kernels.triton.ops import TritonOps

    x, experts, weights, ids = _random_step(tokens, hidden, inter, num_experts, top_k, dtype, seed=tokens)
    for_torch = ExpertWeights(experts.gate_up.clone(), experts.down.clone())  # the torch path may repack its own
    got = TritonOps().moe(x, experts, weights, ids)
    expected = TorchOps().moe(x, for_torch, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_sorting_37_tokens_top_2_over_8_experts_pads_each_expert_to_whole_16_row_tiles() -> None:
    from batchprefill.kernels.triton.moe import sort_by_expert

    ids = torch.randint(0, 8, (37, 2), generator=torch.Generator().manual_seed(6))
    ids[:, 1] = (ids[:, 0] + 1) % 8  # two distinct experts per token, as top-k gives
    ids[ids == 5] = 4  # expert 5 gets no rows (a token may then repeat expert 4: the sort does not care)
    sorted_pairs, tile_experts = sort_by_expert(ids, 8, 16)
    assert sorted_pairs.numel() == tile_experts.numel() * 16 == 16 * -(-(74 + 8 * 15) // 16)
    counts = torch.bincount(ids.flatten(), minlength=8)
    tiles = sorted_pairs.view(-1, 16)
    for expert in range(8):
        mine = tiles[tile_experts == expert]
        assert mine.shape[0] == -(-int(counts[expert]) // 16)  # whole tiles, no spare one
        real = mine[mine < 74]
        assert (ids.flatten()[real.long()] == expert).all() and real.numel() == counts[expert]
    assert (tiles[tile_experts == 8] == 74).all()  # tiles past the end hold only the sentinel
    assert sorted(sorted_pairs[sorted_pairs < 74].tolist()) == list(range(74))  # every pair exactly once


@pytest.mark.skipif(not onednn_packs(torch.zeros(1)), reason="this torch build has no oneDNN")
def test_experts_packed_for_the_cpu_keep_one_copy_and_refuse_the_fused_kernel() -> None:
    from batchprefill.kernels.triton.ops import TritonOps

    x, experts, weights, ids = _random_step(5, 32, 16, 4, 2, torch.float32, seed=7)
    TorchOps().moe(x, experts, weights, ids)
    assert experts.gate_up is None and experts.down is None and len(experts.linears) == 4
    with pytest.raises(ValueError, match="packed for the CPU"):
        TritonOps().moe(x, experts, weights, ids)


def _fp8_experts(matrices: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight:
    """A stack of expert matrices in the test's own FP8: per block of `block` (scales whose ranges differ up to
    100-fold between blocks), or per row with `block` None."""
    experts, rows, columns = matrices.shape
    if block is None:
        scale = matrices.abs().amax(dim=2) / 448
        return Fp8Weight((matrices / scale[:, :, None]).to(torch.float8_e4m3fn), scale)
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    spread = torch.logspace(-1, 1, 5)[torch.randint(0, 5, (experts, *grid), generator=torch.Generator().manual_seed(9))]
    per_value = spread.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)[:, :rows, :columns]
    matrices = matrices * per_value
    scale = torch.zeros(experts, *grid)
    values = torch.empty(matrices.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = matrices[:, i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[:, i, j] = tile.abs().amax(dim=(1, 2)) / 448
            values[:, i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                tile / scale[:, i, j, None, None]).to(torch.float8_e4m3fn)
    return Fp8Weight(values, scale, block)


@pytest.mark.parametrize("block", [(16, 32), (32, 16), None], ids=["16x32-blocks", "32x16-blocks", "per-row"])
def test_fp8_experts_give_the_bits_of_the_same_experts_dequantized_at_load(block) -> None:
    """The fused kernels widen FP8 experts in registers, each weight times its block's (or row's) scale rounded
    once to bfloat16, as dequantizing at load rounds it: the same bits out, on 37 tokens over 8 experts top-2
    (hidden 64, intermediate 48: a gate/up stack of 96 rows, ragged against 32-row blocks). 16-column blocks make
    the launch take 16-deep inner tiles."""
    from batchprefill.kernels.triton.ops import TritonOps

    x, experts, weights, ids = _random_step(37, 64, 48, 8, 2, torch.float32, seed=8)
    gate_up, down = (_fp8_experts(matrices, block) for matrices in experts.stacked())
    dequantized = ExpertWeights(*(torch.stack([w.select(e).dequantize(torch.bfloat16) for e in range(8)])
                                  for w in (gate_up, down)))
    got = TritonOps().moe(x.bfloat16(), ExpertWeights(gate_up, down), weights, ids)
    want = TritonOps().moe(x.bfloat16(), dequantized, weights, ids)
    assert torch.equal(got, want)
    mixed = TritonOps().moe(x.bfloat16(), ExpertWeights(gate_up, dequantized.down), weights, ids)  # down in 16 bits
    assert torch.equal(mixed, want)
    assert want.abs().amax().item() > 0.1  # outputs of order 1: a scale read from the wrong block would show
