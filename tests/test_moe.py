"""The mixture-of-experts MLP against transformers' own sparse-MoE blocks, and the fused Triton kernel against
the torch grouped path (under the interpreter, from tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchprefill.kernels.experts import ExpertWeights, torch_experts
from batchprefill.kernels.ops import TorchOps
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
    calls: list[int] = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, *a: calls.append(x.shape[0]) or linear(x, w, *a))
    got = torch_experts(hidden, experts, weights, ids)
    assert sorted(calls) == [6, 6, 7, 7, 7, 7]  # experts 0, 1, 3 take 7, 6, 7 rows; each runs two matmuls
    expected = torch.zeros_like(hidden)
    for t in range(10):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = linear(hidden[t], experts.gate_up[e]).chunk(2)
            expected[t] += weights[t, k] * linear(torch.nn.functional.silu(gate) * up, experts.down[e])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
