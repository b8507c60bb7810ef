"""Mistral: Llama with an optional sliding window (`sliding_window`) on every layer."""

from __future__ import annotations

from batchprefill.model.config import ModelConfig, base_fields
from batchprefill.model.families.base import Family, llama_layer


def config(raw: dict, architecture: str) -> ModelConfig:
    return ModelConfig(**base_fields(raw, architecture))  # base_fields reads sliding_window for every family


FAMILY = Family("mistral", ("MistralForCausalLM",), config, llama_layer)
