"""The layer builder the mixture-of-experts families share: Llama's layer, experts in place of its MLP where
the config marks the layer sparse."""

from __future__ import annotations

from batchprefill.model.families.base import Layer, Weights, llama_layer
from batchprefill.model.moe import ExpertNames, MoeConfig, SparseMoe


def moe_layer(weights: Weights, index: int, config: MoeConfig, names: ExpertNames) -> Layer:
    if not config.sparse_layers[index]:
        return llama_layer(weights, index, config)
    moe = SparseMoe.from_checkpoint(weights, f"model.layers.{index}.", names, config.experts_per_token,
                                    config.normalize_topk)
    return llama_layer(weights, index, config, moe)
