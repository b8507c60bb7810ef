"""FP8 linear weights and the FP8 matmuls of a GPU.

A weight held in FP8 is `data` (float8_e4m3fn `[out, in]`) times float32 scales: one per output channel, what the
compressed-tensors `-FP8-dynamic` checkpoints store and what `model.quantization=fp8` makes at load, or one per
block of 128 x 128 weights, what the block-wise checkpoints store (Qwen3's and DeepSeek-V3's FP8 releases,
compressed-tensors' `block` strategy). On a GPU with FP8 (Ada, Hopper) such a layer stays FP8, and the weights'
bytes, which a decode step reads in full, are half bfloat16's (benchmarks/gpu/gpu_fp8.py measures what that buys).
A call of at most WIDENED_ROWS rows (a decode step's) widens the weights in registers:
- Widened (W8A16, `widened_fp8_matmul`): the FP8 weights are read once, converted to bfloat16 in registers, and
  multiplied by the unquantized rows; the scales multiply the float32 sums. One launch, no error beyond the
  checkpoint's own.
More rows multiply in FP8 (W8A8, `fp8_product`):
- Per channel: each call quantizes its activation rows with one scale per row (dynamic per-token scaling, one
  Triton launch: `kernels/triton/fp8.py`) and hands both to `torch._scaled_mm`'s row-wise path, which applies the
  row and channel scales to the float32 accumulator and writes bfloat16. Per-channel scales keep one row of a
  fused QKV or gate/up matrix with the scale it was quantized with: fusing concatenates data and scales along the
  same axis.
- Per block: each call quantizes its activations with one scale per row and 128 columns (as the checkpoints'
  reference code does), then a Triton kernel multiplies tile by tile, applying both scales to each 128-deep
  float32 product before summing (`block_fp8_matmul`). Before it, block-wise weights were dequantized to bfloat16
  on the GPU at load: twice the bytes, so a 70B block-wise checkpoint did not fit one card.

`_scaled_mm`'s row-wise path (torch 2.11, Hopper): `mat1` `[M, K]` row-major FP8, `mat2` `[K, N]` column-major
FP8 (the `[N, K]` weight transposed, a view), `scale_a` float32 `[M, 1]`, `scale_b` float32 `[1, N]`, both
contiguous, `out_dtype` bfloat16, K and N multiples of 16 (M is free). Layers that do not meet that or the block
kernel's terms, and every CPU, get the weight dequantized to the compute dtype at load (`model/weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchprefill.intmath import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A row or channel of zeros gets this scale instead of 0, so that dividing by it stays finite.
MIN_AMAX = 1e-12
# At most this many rows multiply with the weights widened to bfloat16 in registers (W8A16, `widened_fp8_matmul`);
# more rows are quantized and multiplied in FP8 (W8A8). On the H200, W8A8 at Llama-3-8B's decode shapes took
# 0.94-1.02x bfloat16's time at 1-64 rows (BENCHMARKS.md): the rows' quantize launch and `_scaled_mm`'s fixed cost
# ate the halved weight read. A decode step's few rows need the bytes halved, not FP8's tensor-core rate, which
# pays only where the product outweighs the weight read: bfloat16's measured 685-803 TFLOP/s take as long as the
# FP8 weights' read at 4.2 TB/s near 80 rows, and 64 is the power of two below. The crossover on a GPU is for
# benchmarks/gpu/gpu_fp8.py to measure (it times both ways at 1-512 rows).
WIDENED_ROWS = 64


@dataclass
class Fp8Weight:
    """A linear weight as FP8 `data` `[out, in]` times float32 `scale`: one per output channel (`scale` `[out]`,
    `block` None), or one per `block` of (rows, columns) weights (`scale` `[ceil(out / rows), ceil(in / columns)]`).
    A layer's experts are a stack of them (`stack_weights`: one more leading axis on both), `select` one of it."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the checkpoint means it: each FP8 value times its channel's or block's scale, in float32,
        then rounded once to `dtype`."""
        if self.block is None:
            return (self.data.float() * self.scale[:, None]).to(dtype)
        rows, columns = self.block
        out_features, in_features = self.data.shape
        per_value = self.scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)[:out_features, :in_features]
        return (self.data.float() * per_value).to(dtype)

    def select(self, index: int) -> Fp8Weight:
        """Matrix `index` of a stack of them (the experts of a layer, `stack_weights`)."""
        return Fp8Weight(self.data[index], self.scale[index], self.block)


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


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[M, K]` as FP8 with one float32 scale per row and `group` columns `[M, ceil(K / group)]` (the
    block-wise checkpoints' dynamic scaling): the torch reference of the Triton kernel, rounded the same way."""
    rows, width = x.shape
    count = cdiv(width, group)
    groups = F.pad(x.float(), (0, count * group - width)).view(rows, count, group)
    scale = groups.abs().amax(dim=2).clamp(min=MIN_AMAX) / FP8_MAX
    values = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.view(rows, count * group)[:, :width], scale


def concat_weights(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Weights stacked along the output axis (fused QKV, gate/up): FP8 parts keep their per-channel scales row
    for row, and block-scaled parts their scale rows where every part but the last fills whole blocks; any other
    fusion is dequantized, to the other parts' dtype or to bfloat16, the one dtype FP8 weights are held in."""
    blocks = {part.block for part in parts if isinstance(part, Fp8Weight)}
    if len(blocks) == 1 and all(isinstance(part, Fp8Weight) for part in parts):
        block = blocks.pop()
        if block is None or all(part.shape[0] % block[0] == 0 for part in parts[:-1]):
            return Fp8Weight(torch.cat([part.data for part in parts]), torch.cat([part.scale for part in parts]),
                             block)
    return torch.cat(_dequantized(parts))


def stack_weights(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Matrices of one shape stacked along a new first axis (a layer's experts): FP8 where every part is, with one
    block shape, their scales stacked alike; else every part in the other parts' dtype or bfloat16, as
    `concat_weights` dequantizes."""
    blocks = {part.block for part in parts if isinstance(part, Fp8Weight)}
    if len(blocks) == 1 and all(isinstance(part, Fp8Weight) for part in parts):
        return Fp8Weight(torch.stack([part.data for part in parts]), torch.stack([part.scale for part in parts]),
                         blocks.pop())
    return torch.stack(_dequantized(parts))


def _dequantized(parts: list[torch.Tensor | Fp8Weight]) -> list[torch.Tensor]:
    """Every part in the 16-bit parts' dtype, or in bfloat16, the one dtype FP8 weights are held in."""
    dtype = next((part.dtype for part in parts if isinstance(part, torch.Tensor)), torch.bfloat16)
    return [part.dequantize(dtype) if isinstance(part, Fp8Weight) else part for part in parts]


def multiplies_fp8(weight: Fp8Weight) -> bool:
    """Whether the FP8 matmul takes this weight (the loader asks for it on a GPU only, `loader.fp8_multiplies`):
    per channel, `_scaled_mm`'s row-wise path takes inner and outer sizes that are multiples of 16; per block, see
    `block_kernel_takes`."""
    out_features, in_features = weight.shape
    if weight.block is None:
        return out_features % 16 == 0 and in_features % 16 == 0
    return block_kernel_takes(weight.block)


def block_kernel_takes(block: tuple[int, int]) -> bool:
    """Whether the block kernel multiplies weights scaled per `block` (rows, columns): its inner tile is one block's
    columns, which `tl.dot` takes as a power of two from 16 (256 at most, to fit the tiles in shared memory)."""
    columns = block[1]
    return 16 <= columns <= 256 and columns & (columns - 1) == 0


def widens(rows: int) -> bool:
    """Whether an FP8 linear called on `rows` rows widens its weights (W8A16) rather than multiplying in FP8."""
    return rows <= WIDENED_ROWS


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` on a GPU for `x` `[M, in]` bfloat16, out bfloat16: with the weights widened in
    registers where M is at most WIDENED_ROWS, else multiplied in FP8 (`fp8_product`)."""
    from batchprefill.kernels.triton import fp8  # triton only where it runs

    out = fp8.widened_fp8_matmul(x, weight) if widens(x.shape[0]) else fp8_product(x, weight)
    return out if bias is None else out.add_(bias)


def fp8_product(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`x @ weight.T` in FP8 (W8A8): `x` quantized per row (per row and block of columns for a block-scaled
    weight), then one scaled matmul with a float32 accumulator; out in x's dtype."""
    from batchprefill.kernels.triton import fp8

    if weight.block is None:
        quantized, row_scale = fp8.quantize_rows_triton(x)
        return torch._scaled_mm(quantized, weight.data.t(), scale_a=row_scale, scale_b=weight.scale[None, :],
                                out_dtype=x.dtype)
    quantized, group_scale = fp8.quantize_groups_triton(x, weight.block[1])
    return fp8.block_fp8_matmul(quantized, group_scale, weight.data, weight.scale, weight.block, x.dtype)
