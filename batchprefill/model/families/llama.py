"""Llama (SmolLM2, Llama 3.x) and Qwen2 (Llama with biases on Q, K and V): the skeleton as it is."""

from __future__ import annotations

from batchprefill.model.config import ModelConfig, base_fields
from batchprefill.model.families.base import Family, llama_layer

QKV_BIAS = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True}


def config(raw: dict, architecture: str) -> ModelConfig:
    return ModelConfig(**base_fields(raw, architecture, default_qkv_bias=QKV_BIAS[architecture]))


FAMILY = Family("llama", tuple(QKV_BIAS), config, llama_layer)
