"""FP8 activations and the block-scaled FP8 matmul of a GPU (`kernels/fp8.py` calls them).

Dynamic per-token quantization in one launch: each program reads one row, finds its largest magnitude, and writes
the row in float8_e4m3fn with the row's float32 scale (for `_scaled_mm`'s row-wise path). In torch the same takes
five launches (abs, amax, a clamp and a division on the scales, then the division with its cast), each reading or
writing the row again; on a decode step of a few rows those launches, not the bytes, are the cost. The block-wise
checkpoints' activations are quantized per token and group of 128 columns instead (`quantize_groups_triton`), as
their reference code does, and multiplied by `block_fp8_matmul`.

The rounding to FP8 is done here in float32 arithmetic, to the nearest value and ties to even as torch's cast
does, so that the final cast is exact. Triton's CPU interpreter casts float32 to FP8 wrongly where rounding up
crosses a power of two (124.6 became 64, not 128: measured under Triton 3.9), and with the rounding done first
the interpreter and a GPU agree with `kernels/fp8.quantize_rows` and `quantize_groups` bit for bit
(tests/test_fp8_checkpoints.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from batchprefill.intmath import cdiv
from batchprefill.kernels.fp8 import FP8, FP8_MAX, MIN_AMAX, Fp8Weight
from batchprefill.kernels.triton.attention import dot_settings, jit_unspecialized

# Adding then subtracting 1.5 x 2^23 rounds a float32 of magnitude below 2^22 to an integer, ties to even.
ROUNDING_MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _fp8_grid(y, FP8_LIMIT: tl.constexpr):
    """`y` (float32) clamped to the FP8 range and rounded to the nearest FP8 value, ties to even, still in float32."""
    y = tl.minimum(tl.maximum(y, -FP8_LIMIT), FP8_LIMIT)
    # The FP8 spacing at |y|: 3 mantissa bits below its power of two, never finer than the subnormals' 2^-9.
    magnitude = tl.abs(y)
    exponent = (magnitude.to(tl.int32, bitcast=True) >> 23) - 127
    spacing_exponent = tl.maximum(exponent - 3, -9)
    spacing = ((spacing_exponent + 127) << 23).to(tl.float32, bitcast=True)
    per_spacing = ((127 - spacing_exponent) << 23).to(tl.float32, bitcast=True)  # 1 / spacing, exactly
    rounded = ((magnitude * per_spacing + ROUNDING_MAGIC) - ROUNDING_MAGIC) * spacing
    negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 and -1e-6 stay -0 as torch's cast keeps them
    return tl.where(negative, -rounded, rounded)


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
        rounded = _fp8_grid(tl.div_rn(x, scale), FP8_LIMIT)
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


@triton.jit
def _quantize_groups_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_xk, stride_om, stride_sm,
                            FP8_LIMIT: tl.constexpr, MIN_MAX: tl.constexpr, GROUP: tl.constexpr,
                            GROUPS: tl.constexpr):
    """GROUPS groups of GROUP columns of one row per program, each with its own scale."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ks = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_xm + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_MAX), FP8_LIMIT)
    rounded = _fp8_grid(tl.div_rn(x, scale[:, None]), FP8_LIMIT)
    tl.store(out_ptr + row * stride_om + ks, rounded.to(tl.float8e4nv), mask=ks < K)
    tl.store(scale_ptr + row * stride_sm + groups, scale, mask=groups * GROUP < K)


def quantize_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[M, K]` as FP8 `[M, K]` and float32 scales `[M, ceil(K / group)]`, one per row and `group` columns (a
    power of two): equal to `quantize_groups(x, group)`."""
    rows, width = x.shape
    count = cdiv(width, group)
    out = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, count, dtype=torch.float32, device=x.device)
    if rows:
        groups = max(1, min(triton.next_power_of_2(count), 1024 // group))  # about 1,024 values a program
        _quantize_groups_kernel[(rows, cdiv(count, groups))](
            x, out, scale, width, x.stride(0), x.stride(1), out.stride(0), scale.stride(0), FP8_LIMIT=FP8_MAX,
            MIN_MAX=MIN_AMAX, GROUP=group, GROUPS=groups)
    return out, scale


@jit_unspecialized("M")
def _block_matmul_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_bn,
                         stride_bsn, stride_cm, BLOCK_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of `a @ b.T`: each BLOCK_K step (one scale group of both) multiplies in FP8 with
    a float32 result, scaled by the rows' group scales and the weight block's scale before it is summed."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    weight_block = columns // BLOCK_ROWS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + inner
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + columns[None, :].to(tl.int64) * stride_bn + ks[:, None],
                    mask=(columns[None, :] < N) & (ks[:, None] < K), other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * stride_asm + step, mask=rows < M, other=0.0)
        b_scale = tl.load(b_scale_ptr + weight_block * stride_bsn + step, mask=columns < N, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + columns[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (columns[None, :] < N))


def block_fp8_matmul(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype, block_n: int | None = None) -> torch.Tensor:
    """`x @ weight.T` for FP8 `x` `[M, K]` with scales `[M, ceil(K / block[1])]` and an FP8 `weight` `[N, K]`
    with one scale per `block` (`[ceil(N / block[0]), ceil(K / block[1])]`), summed in float32, out in
    `out_dtype`. The inner tile is one scale group (block[1] columns, a power of two from 16). A program takes 64
    rows and `block_n` output columns: by default the widest of 128, 64 and 32 that still gives every
    multiprocessor a program, since a decode step's few rows make one row tile, and the weights, which are the
    bytes such a step reads, stream only as fast as the multiprocessors that read them (the down projection at
    Llama-3-8B's shape is 32 tiles of 128 columns, a quarter of an H200's 132). No split of the inner sum, and
    one tile shape per row count: a batch-invariant linear, which always hands 128 rows, gets the same tiles at
    every step. The tiles are a first choice that no GPU has measured yet (benchmarks/gpu/gpu_fp8.py times them)."""
    rows, _ = x.shape
    out_features, inner = weight.shape
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("block_fp8_matmul reads rows and weights whose columns are adjacent (stride 1)")
    out = torch.empty(rows, out_features, dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 64
    if block_n is None:
        row_tiles, programs = cdiv(rows, block_m), _multiprocessors(x.device)
        block_n = next((n for n in (128, 64) if row_tiles * cdiv(out_features, n) >= programs), 32)
    grid = (cdiv(rows, block_m), cdiv(out_features, block_n))
    _block_matmul_kernel[grid](x, x_scale, weight, weight_scale, out, rows, out_features, inner, x.stride(0),
                               x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
                               BLOCK_ROWS=block[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1],
                               num_warps=4, num_stages=3)
    return out


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (132 on an H100 or H200); 1 elsewhere (the CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@jit_unspecialized("M")  # a step's row count: one variant for every count that takes a tile size
def _widened_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                           stride_om, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, PER_BLOCK: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of `x @ (w * scale).T`: each BLOCK_K step widens its FP8 weights to x's dtype
    (exact: every e4m3 value is a bfloat16) for one 16-bit dot with a float32 result. Per block, each step lies in
    one scale block along the inner axis and is scaled before it is summed; per channel, the sum is scaled once."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    column_scales = scale_ptr + (columns // SCALE_ROWS) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + inner
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + columns[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=(columns[None, :] < N) & (ks[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter's 16-bit dot is wrong (`interpreting`): both widened to float32, exactly
            x, w = x.to(tl.float32), w.to(tl.float32)
        else:
            w = w.to(x_ptr.dtype.element_ty)
        if PER_BLOCK:
            scale = tl.load(column_scales + (k0 // SCALE_COLS) * stride_sk, mask=columns < N, other=0.0)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * scale[None, :]
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if not PER_BLOCK:
        acc *= tl.load(column_scales, mask=columns < N, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + columns[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (columns[None, :] < N))


def widened_fp8_matmul(x: torch.Tensor, weight: Fp8Weight, out_dtype: torch.dtype | None = None,
                       block_n: int | None = None, block_k: int | None = None,
                       num_stages: int = 4) -> torch.Tensor:
    """`x @ weight.T` for 16-bit `x` `[M, K]` and an FP8 `weight` `[N, K]` scaled per channel or per block: the
    weights are widened to x's dtype in registers (W8A16), so the rows are not quantized and no launch precedes
    the product; summed in float32, out in `out_dtype` (x's by default). What a decode step's few rows need: the
    FP8 weights are read once, at half bfloat16's bytes (`kernels/fp8.WIDENED_ROWS` says when the GPU takes it).
    - A program takes 16 rows, or 64 past 16: one tile holds a decode step's rows, so the weights stream once, and
      each layer compiles two variants (the row count itself is not specialized on).
    - It takes `block_n` output columns: by default the widest of 64, 32 and 16 that gives every multiprocessor
      two programs, so each has a second stream of weights in flight while the first waits on memory.
    - The inner step `block_k` is 128 (a block's columns where they are fewer).
    `block_n`, `block_k` and `num_stages` are for benchmarks/gpu/gpu_fp8.py's sweep: no GPU has measured any of
    these choices yet."""
    rows, inner = x.shape
    out_features = weight.shape[0]
    if x.stride(1) != 1 or weight.data.stride(1) != 1:
        raise ValueError("widened_fp8_matmul reads rows and weights whose columns are adjacent (stride 1)")
    out = torch.empty(rows, out_features, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 64
    if block_n is None:
        row_tiles, programs = cdiv(rows, block_m), 2 * _multiprocessors(x.device)
        block_n = next((n for n in (64, 32) if row_tiles * cdiv(out_features, n) >= programs), 16)
    if weight.block is None:  # per channel: one scale a row of the weight, read once after the sum
        scale_rows, scale_cols, stride_sk, block_k = 1, 1, 0, block_k or 128
    else:
        (scale_rows, scale_cols), stride_sk = weight.block, weight.scale.stride(1)
        block_k = min(block_k or 128, scale_cols)
    upcast, precision = dot_settings(x.dtype)
    grid = (cdiv(rows, block_m), cdiv(out_features, block_n))
    _widened_matmul_kernel[grid](x, weight.data, weight.scale, out, rows, out_features, inner, x.stride(0),
                                 weight.data.stride(0), weight.scale.stride(0), stride_sk, out.stride(0),
                                 SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, PER_BLOCK=weight.block is not None,
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
                                 DOT_PRECISION=precision, num_warps=4, num_stages=num_stages)
    return out
