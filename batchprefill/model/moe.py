"""A sparse mixture-of-experts MLP: a softmax router picks `top_k` SwiGLU experts per token.

Qwen3-MoE and Mixtral share it; they differ in checkpoint names and in whether the top-k probabilities are
renormalised (Qwen3-MoE's `norm_topk_prob`; Mixtral always, which equals a softmax over the top-k logits).
The experts themselves run in the compute backend (`Ops.moe`), grouped by expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.interface import Ops
from batchprefill.kernels.linear import Linear
from batchprefill.model.config import ModelConfig


@dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """A Llama-shaped model whose `sparse_layers` replace the gated MLP with routed experts."""

    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one expert's gate/up width
    normalize_topk: bool = True  # renormalise the top-k router probabilities to sum to 1
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP of `intermediate_size`

    def num_parameters(self) -> int:
        """Active parameters per token (router and `experts_per_token` experts in a sparse layer): the N of
        the 2·tokens·N FLOP estimate, which counts what a token computes, not what the model stores."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        sparse_mlp = self.hidden_size * (self.num_experts + 3 * self.experts_per_token * self.moe_intermediate_size)
        swapped = sum(sparse_mlp - dense_mlp for sparse in self.sparse_layers if sparse)
        every_layer_dense = self.num_layers * (self.attention_parameters() + dense_mlp)
        return every_layer_dense + self.vocab_size * self.hidden_size + swapped

    def dense_linear_parameters(self) -> int:
        """Attention everywhere, the gated MLP only in the dense layers."""
        dense_mlps = (self.num_layers - sum(self.sparse_layers)) * 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * self.attention_parameters() + dense_mlps

    def expert_parameters(self) -> int:
        """Every expert of the sparse layers (all stored, whichever run)."""
        return sum(self.sparse_layers) * 3 * self.num_experts * self.hidden_size * self.moe_intermediate_size

    def other_parameters(self) -> int:
        """Beside the embedding and heads, the sparse layers' routers."""
        return super().other_parameters() + sum(self.sparse_layers) * self.hidden_size * self.num_experts


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 `[T, K]`, expert ids `[T, K]`): the `top_k` largest router probabilities, softmax
    taken in float32 over all experts, renormalised to sum to 1 when `normalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertNames:
    """Where one family's checkpoint keeps a layer's MoE weights, relative to `model.layers.{i}.`."""

    block: str  # "mlp." (Qwen3-MoE) or "block_sparse_moe." (Mixtral)
    gate: str  # per-expert projection names: gate_proj / w1
    up: str  # up_proj / w3
    down: str  # down_proj / w2


class SparseMoe:
    """`x [T, H]` -> `[T, H]`: router, top-k, then the backend's grouped experts."""

    def __init__(self, router: torch.Tensor, experts: ExpertWeights, top_k: int, normalize: bool):
        self.router = Linear(router)
        self.experts = experts
        self.top_k = top_k
        self.normalize = normalize

    def __call__(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, self.normalize)
        return ops.moe(x, self.experts, weights, ids)

    @classmethod
    def from_checkpoint(cls, weights: dict[str, torch.Tensor], layer_prefix: str, names: ExpertNames,
                        top_k: int, normalize: bool) -> SparseMoe:
        """Reads the per-expert matrices checkpoints store (`experts.{e}.{gate}.weight`), popping them from
        `weights` so that stacking them does not hold the layer twice for long."""
        block = layer_prefix + names.block
        router = weights.pop(block + "gate.weight")
        per_expert = [block + f"experts.{e}." for e in range(router.shape[0])]
        experts = ExpertWeights.stack(
            [weights.pop(p + names.gate + ".weight") for p in per_expert],
            [weights.pop(p + names.up + ".weight") for p in per_expert],
            [weights.pop(p + names.down + ".weight") for p in per_expert],
        )
        return cls(router, experts, top_k, normalize)

