"""RoPE tables: the model's rotary frequencies, as one cos|sin table the backends index by position."""

from __future__ import annotations

import torch


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The `[max_positions, head_dim]` cos|sin table for rotate-half RoPE, in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


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
