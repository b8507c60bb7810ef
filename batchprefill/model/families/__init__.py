"""Every supported model family, found by the architecture name in `config.json`.

Adding a family means adding a file beside this one that defines `FAMILY`, and listing it here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from batchprefill.model import heads
from batchprefill.model.config import ModelConfig
from batchprefill.model.families import gemma3, llama, mistral, mixtral, phi3, qwen3, qwen3_moe
from batchprefill.model.families.base import Family
from batchprefill.model.quantization import read_quantization

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, mistral.FAMILY, gemma3.FAMILY, phi3.FAMILY,
                                qwen3_moe.FAMILY, mixtral.FAMILY)
ARCHITECTURES: dict[str, Family] = {arch: family for family in FAMILIES for arch in family.architectures}


class UnsupportedArchitecture(ValueError):
    pass


def family_for(architecture: str) -> Family:
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {architecture} is not supported; supported: {', '.join(sorted(ARCHITECTURES))} "
            "(each also as *Model and *ForSequenceClassification)")
    return ARCHITECTURES[architecture]


def read_config(folder: Path) -> ModelConfig:
    """The ModelConfig of an HF folder, parsed by its family's causal LM, with the folder's head (model/heads.py)
    and quantization (model/quantization.py); a file with no `architectures` is Llama."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    architecture, head = heads.split_architecture((raw.get("architectures") or ["LlamaForCausalLM"])[0],
                                                  ARCHITECTURES)
    if "text_config" in raw:  # Gemma3ForSequenceClassification wraps the multimodal model
        raise ValueError(f"{raw['architectures'][0]} is a multimodal model; only text models are supported")
    config = family_for(architecture).config(raw, architecture)
    return replace(config, head=head, num_labels=heads.num_labels(raw) if head == heads.SCORE else 0,
                   quantization=read_quantization(raw))
