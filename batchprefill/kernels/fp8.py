"""FP8 linear weights and the FP8 matmul of a GPU.

A weight held in FP8 is `data` (float8_e4m3fn `[out, in]`) times one float32 `scale` per output channel: what
the compressed-tensors `-FP8-dynamic` checkpoints store and what `model.quantization=fp8` makes at load. On a
Hopper GPU such a layer multiplies in FP8: each call quantizes its activation rows with one scale per row
(dynamic per-token scaling, one Triton launch: `kernels/triton/fp8.py`) and hands both to `torch._scaled_mm`'s
row-wise path, which applies the row and channel scales to the float32 accumulator and writes bfloat16. The
weights' bytes, which a decode step reads in full, are half bfloat16's; the benchmark that measures what that buys
is benchmarks/gpu/gpu_fp8.py (nothing has measured it yet). Per-channel scales keep one row of a fused QKV or
gate/up matrix with the scale it was quantized with: fusing concatenates data and scales along the same axis.

`_scaled_mm`'s row-wise path (torch 2.11, Hopper): `mat1` `[M, K]` row-major FP8, `mat2` `[K, N]` column-major
FP8 (the `[N, K]` weight transposed, a view), `scale_a` float32 `[M, 1]`, `scale_b` float32 `[1, N]`, both
contiguous, `out_dtype` bfloat16, K and N multiples of 16 (M is free). Layers that do not meet that, and every
CPU, get the weight dequantized to the compute dtype at load (`model/quantization.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A row or channel of zeros gets this scale instead of 0, so that dividing by it stays finite.
MIN_AMAX = 1e-12


@dataclass
class Fp8Weight:
    """A linear weight as FP8 `data` `[out, in]` times `scale` `[out]` (float32), row by row."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the checkpoint means it: each FP8 value times its channel's scale, in float32, then
        rounded once to `dtype`."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


def quantize_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """A weight `[out, in]` in FP8 with one scale per output channel: its largest magnitude maps to 448, so no
    value saturates, and every value is rounded to the nearest FP8 (3 mantissa bits: at most 1/16 of itself
    away)."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
    return Fp8Weight((weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[M, K]` as FP8 with one float32 scale per row `[M, 1]` (dynamic per-token scaling): the
    torch reference of the Triton kernel, which rounds the same way (to nearest, ties to even)."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def concat_weights(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Weights stacked along the output axis (fused QKV, gate/up): FP8 parts keep their per-channel scales row
    for row; a fusion a checkpoint quantized only partly is dequantized to the other parts' dtype."""
    if all(isinstance(part, Fp8Weight) for part in parts):
        return Fp8Weight(torch.cat([part.data for part in parts]), torch.cat([part.scale for part in parts]))
    dtype = next(part.dtype for part in parts if isinstance(part, torch.Tensor))
    return torch.cat([part.dequantize(dtype) if isinstance(part, Fp8Weight) else part for part in parts])


def multiplies_fp8(weight: Fp8Weight) -> bool:
    """Whether `_scaled_mm`'s row-wise path takes this weight: on a GPU, inner and outer size multiples of 16."""
    out_features, in_features = weight.shape
    return weight.data.device.type == "cuda" and out_features % 16 == 0 and in_features % 16 == 0


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` in FP8 on a GPU: `x` `[M, in]` bfloat16, quantized per row, then one scaled matmul
    with a float32 accumulator; bfloat16 out."""
    from batchprefill.kernels.triton.fp8 import quantize_rows_triton  # triton only where it runs

    quantized, row_scale = quantize_rows_triton(x)
    out = torch._scaled_mm(quantized, weight.data.t(), scale_a=row_scale, scale_b=weight.scale[None, :],
                           out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)
