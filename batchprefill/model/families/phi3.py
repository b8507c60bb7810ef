"""Phi-3 and Phi-4-mini: Q, K and V stored as one `qkv_proj`, gate and up as one `gate_up_proj`; partial
rotary (`partial_rotary_factor`) and longrope scaling where configured (both read by base_fields)."""

from __future__ import annotations

from batchprefill.kernels.linear import Linear
from batchprefill.model.config import ModelConfig, base_fields
from batchprefill.model.families.base import Family, GatedMLP, Layer, Weights, norm


def config(raw: dict, architecture: str) -> ModelConfig:
    return ModelConfig(**base_fields(raw, architecture))


def layer(weights: Weights, index: int, config: ModelConfig) -> Layer:
    prefix = f"model.layers.{index}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    return Layer(
        input_norm=norm(weights, prefix + "input_layernorm.weight", config),
        qkv=Linear(weights[attn + "qkv_proj.weight"], weights.get(attn + "qkv_proj.bias")),
        o=Linear(weights[attn + "o_proj.weight"]),
        pre_mlp_norm=norm(weights, prefix + "post_attention_layernorm.weight", config),
        mlp=GatedMLP(Linear(weights[mlp + "gate_up_proj.weight"]), Linear(weights[mlp + "down_proj.weight"]),
                     config.hidden_act),
    )


FAMILY = Family("phi3", ("Phi3ForCausalLM",), config, layer)
