"""Mixtral: Mistral (optional sliding window) with every MLP replaced by top-2 routed experts, the top-2
probabilities renormalised (a softmax over the top-2 logits)."""

from __future__ import annotations

from batchprefill.model.config import base_fields
from batchprefill.model.families.base import Family, Layer, Weights
from batchprefill.model.families.sparse import moe_layer
from batchprefill.model.moe import ExpertNames, MoeConfig

NAMES = ExpertNames(block="block_sparse_moe.", gate="w1", up="w3", down="w2")


def config(raw: dict, architecture: str) -> MoeConfig:
    return MoeConfig(
        **base_fields(raw, architecture), num_experts=raw["num_local_experts"],
        experts_per_token=raw["num_experts_per_tok"], moe_intermediate_size=raw["intermediate_size"],
        normalize_topk=True, sparse_layers=(True,) * raw["num_hidden_layers"],
    )


def layer(weights: Weights, index: int, config: MoeConfig) -> Layer:
    return moe_layer(weights, index, config, NAMES)


FAMILY = Family("mixtral", ("MixtralForCausalLM",), config, layer)
