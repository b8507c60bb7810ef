"""Qwen3: Llama with an RMSNorm over each query and key head before RoPE, and no Q/K/V biases."""

from __future__ import annotations

from batchprefill.model.config import ModelConfig, base_fields
from batchprefill.model.families.base import Family, llama_layer


def config(raw: dict, architecture: str) -> ModelConfig:
    return ModelConfig(**base_fields(raw, architecture), qk_norm=True)


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), config, llama_layer)
