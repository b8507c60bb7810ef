"""Dynamic per-token FP8 quantization of activations in one launch: each program reads one row, finds its largest
magnitude, and writes the row in float8_e4m3fn with the row's float32 scale (`kernels/fp8.py` multiplies with it).

In torch the same takes five launches (abs, amax, a clamp and a division on the scales, then the division with
its cast), each reading or writing the row again; on a decode step of a few rows those launches, not the bytes,
are the cost.

The rounding to FP8 is done here in float32 arithmetic, to the nearest value and ties to even as torch's cast
does, so that the final cast is exact. Triton's CPU interpreter casts float32 to FP8 wrongly where rounding up
crosses a power of two (124.6 became 64, not 128: measured under Triton 3.9), and with the rounding done first
the interpreter and a GPU agree with `kernels/fp8.quantize_rows` bit for bit (tests/test_fp8_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchprefill.kernels.fp8 import FP8, FP8_MAX, MIN_AMAX

# Adding then subtracting 1.5 x 2^23 rounds a float32 of magnitude below 2^22 to an integer, ties to even.
ROUNDING_MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_xk, stride_om,
                          FP8_LIMIT: tl.constexpr, MIN_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_MAX), FP8_LIMIT)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
        # The FP8 spacing at |y|: 3 mantissa bits below its power of two, never finer than the subnormals' 2^-9.
        magnitude = tl.abs(y)
        exponent = (magnitude.to(tl.int32, bitcast=True) >> 23) - 127
        spacing_exponent = tl.maximum(exponent - 3, -9)
        spacing = ((spacing_exponent + 127) << 23).to(tl.float32, bitcast=True)
        per_spacing = ((127 - spacing_exponent) << 23).to(tl.float32, bitcast=True)  # 1 / spacing, exactly
        rounded = ((magnitude * per_spacing + ROUNDING_MAGIC) - ROUNDING_MAGIC) * spacing
        negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 and -1e-6 stay -0 as torch's cast keeps them
        rounded = tl.where(negative, -rounded, rounded)
        tl.store(out_ptr + row * stride_om + ks, rounded.to(tl.float8e4nv), mask=ks < K)
    tl.store(scale_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[M, K]` as FP8 `[M, K]` (row-major) and float32 scales `[M, 1]`: equal to `quantize_rows(x)`."""
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(width), 4096)
        _quantize_rows_kernel[(rows,)](x, out, scale, width, x.stride(0), x.stride(1), out.stride(0),
                                       FP8_LIMIT=FP8_MAX, MIN_MAX=MIN_AMAX, BLOCK=block)
    return out, scale
