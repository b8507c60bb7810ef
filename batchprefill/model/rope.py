"""RoPE tables: the model's rotary frequencies, as one cos|sin table the backends index by position."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The `[max_positions, head_dim]` cos|sin table for rotate-half RoPE, in float32.

    `head_dim` is the rotated width (less than the head under partial rotary). Longrope's table takes its
    short factors below `original_max_position_embeddings` and its long ones from there on: per position,
    so a block's KV never depends on how long its sequence grows (transformers picks one set for the whole
    sequence by its length; the two agree on every sequence within the original context).
    """
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(max_positions, dtype=torch.float64)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "longrope":
        return _longrope_table(exponents, positions, theta, scaling, max_positions)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _longrope_table(exponents: torch.Tensor, positions: torch.Tensor, theta: float, scaling: dict,
                    max_positions: int) -> torch.Tensor:
    """Phi-3's longrope: per-frequency stretch factors (short or long) and an attention factor on cos and sin."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    tables = []
    for ext in (scaling["short_factor"], scaling["long_factor"]):
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float64) * theta**exponents)
        angles = torch.outer(positions, inv_freq)
        tables.append(torch.cat([angles.cos(), angles.sin()], dim=-1) * attention)
    short, long = tables
    return torch.where((positions < original)[:, None], short, long).float()


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (long wavelengths stretched, short ones kept)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((original / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(middle, blended, scaled)
