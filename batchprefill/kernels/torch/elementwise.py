"""RMSNorm, RoPE, the KV store and the gated MLP's activation as plain torch ops: the reference, and what runs where
the C++ ones (`kernels/native/elementwise.py`) do not (no compiler, dtypes other than float32, other devices)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchprefill.kernels.fp8_kv import is_fp8, to_cache

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # transformers' names (ACT2FN)
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's `act(gate) * up` from the fused projection's output `[T, 2I]` (gate first): `[T, I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    return (x32 * inverse_rms).mul_(weight).to(x.dtype), x


def rope(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    table = cos_sin[positions]  # per call: layers may differ in their table (Gemma 3's two RoPE bases)
    half = table.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    cos, signed_sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return _rotate(query, cos, signed_sin), _rotate(key, cos, signed_sin)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if bool((slot_mapping < 0).any()):  # only padded batches skip rows: avoid masking the common case
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    for source, cache in ((key, k_cache), (value, v_cache)):
        stored = to_cache(source, cache.dtype)
        if is_fp8(cache.dtype):  # torch's index_copy_ has no FP8 kernel: the bytes are copied as bytes
            stored, cache = stored.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, stored)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in three ops: x * cos + (x2, x1) * (-sin, sin)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    swapped = torch.cat([x32[..., half:], x32[..., :half]], dim=-1)
    return torch.addcmul(x32 * cos, swapped, signed_sin).to(x.dtype)
