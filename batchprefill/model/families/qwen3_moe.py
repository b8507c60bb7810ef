"""Qwen3-MoE: Qwen3 (q/k norms) whose MLPs are routed experts, softmax top-k with `norm_topk_prob`; layers in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP."""

from __future__ import annotations

from batchprefill.model.config import base_fields
from batchprefill.model.families.base import Family, Layer, Weights
from batchprefill.model.families.sparse import moe_layer
from batchprefill.model.moe import ExpertNames, MoeConfig

NAMES = ExpertNames(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj")


def config(raw: dict, architecture: str) -> MoeConfig:
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    dense, step = set(raw.get("mlp_only_layers") or ()), raw.get("decoder_sparse_step", 1)
    sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                   for i in range(raw["num_hidden_layers"]))
    return MoeConfig(
        **base_fields(raw, architecture), qk_norm=True, num_experts=num_experts,
        experts_per_token=raw["num_experts_per_tok"], moe_intermediate_size=raw["moe_intermediate_size"],
        normalize_topk=raw.get("norm_topk_prob", False), sparse_layers=sparse,
    )


def layer(weights: Weights, index: int, config: MoeConfig) -> Layer:
    return moe_layer(weights, index, config, NAMES)


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), config, layer)
