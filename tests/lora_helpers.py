"""Tiny random models with random PEFT LoRA adapters, for the LoRA tests (test_lora*.py)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from peft import LoraConfig, get_peft_model

from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.lora import LoraStep

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
ALL_SEPARATE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def tiny_config(kind: str) -> transformers.PretrainedConfig:
    if kind == "llama":
        return transformers.LlamaConfig(**TINY)
    if kind == "qwen2":  # biases on Q, K and V
        return transformers.Qwen2Config(**TINY)
    if kind == "qwen3":
        return transformers.Qwen3Config(**TINY)
    if kind == "mistral":
        return transformers.MistralConfig(**TINY)
    if kind == "phi3":  # Phi-3 has no head_dim key: hidden / heads = 16
        return transformers.Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"})
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**TINY, "tie_word_embeddings": True}, layer_types=["full_attention", "full_attention"]
        )
    raise ValueError(kind)


def save_base(kind: str, folder: Path, model_folder: Path) -> transformers.PreTrainedModel:
    """A random tiny model saved as an HF folder with the shipped tokenizer (and its chat template) beside it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_folder / name, folder / name)
    return model


def save_adapter(
    base: transformers.PreTrainedModel,
    folder: Path,
    seed: int,
    targets: list[str],
    rank: int = 8,
    alpha: int = 16,
    **options,
) -> transformers.PreTrainedModel:
    """A PEFT adapter on a copy of `base` with random A and B (PEFT starts B at zero, a delta of nothing), saved
    to `folder`; returns the PEFT model, the reference."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **options)
    ).eval()
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_" in name:
                weight.copy_(0.2 * torch.randn_like(weight))
    peft_model.save_pretrained(folder)
    return peft_model


def batch_logits(model, prompts: list[list[int]], adapters: list[int], block_size: int = 4) -> list[torch.Tensor]:
    """Every position's logits of each prompt, all prompts in one flat forward pass, prompt i under adapter index
    `adapters[i]` (0: the base model)."""
    cfg = model.config
    tables, offset = [], 0
    for prompt in prompts:
        blocks = -(-len(prompt) // block_size)
        tables.append(list(range(offset, offset + blocks)))
        offset += blocks
    width = max(len(t) for t in tables)
    shape = (offset, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    lens = [len(p) for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat(
        [
            torch.tensor(t)[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
            for t, n in zip(tables, lens)
        ]
    )
    meta = AttentionMetadata(
        query_start=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=slots,
        query_lens_host=lens,
        seq_lens_host=lens,
    )
    step = LoraStep.of(np.repeat(np.array(adapters, dtype=np.int32), lens), torch.device("cpu"))
    ids = torch.tensor([t for p in prompts for t in p])
    logits = model(ids, positions, caches, meta, torch.arange(len(ids)), lora=step)
    return list(logits.split(lens))
