"""A batch-invariant linear on Triton: `y = x @ weight.T + bias` whose rows do not depend on how many rows share
the call, nor on where a row sits among them (`engine.batch_invariant`, `kernels/linear.py`).

cuBLAS picks its kernel from the shape, M included: a split of the inner dimension (split-K) or another tile
changes the order in which a row's products are summed, so a prompt's logits change with the batch it runs in.
Here the tiles, warps and pipeline depth follow only N, K and the dtype, never M; the inner dimension is never
split, and each program walks it from 0 to K in the same `BLOCK_K` steps into an fp32 accumulator. A row's
output is then one fixed sequence of operations on its own inputs, whatever M is: the other rows of its tile
only fill other lanes of the same instructions. M itself is not specialized on (`jit_unspecialized`), so one
compiled variant serves every batch. This trades speed for stability: fixed 64 x 64 tiles are not what cuBLAS
would pick for a 1-row decode or an 8k-token prefill, and no GPU has measured the cost yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchprefill.kernels.triton.attention import dot_settings, interpreting, jit_unspecialized


@jit_unspecialized("M")
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_M rows by BLOCK_N columns of y, the whole inner dimension in BLOCK_K steps."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def linear_tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of an invariant linear, from the dtype alone (a tuning
    may key on the weight's shape too, never on the rows): 64 x 64 output tiles with 64-deep steps for 16-bit
    operands, 32-deep for fp32, whose operands take twice the registers. The interpreter gets 32-wide tiles, as
    its cost is per tile iteration. One tile for every weight until a GPU has measured better ones."""
    if interpreting():
        return 32, 32, 32, 4, 1
    return 64, 64, (32 if dtype == torch.float32 else 64), 4, 3


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x `[..., K]`, weight `[N, K]` (torch's layout), bias `[N]`, in x's dtype,
    each row computed the same way whatever the number of rows. fp32 runs TF32 dots exactly when torch's own fp32
    matmuls may (`dot_settings`)."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    block_m, block_n, block_k, num_warps, num_stages = linear_tiles(x.dtype)
    upcast, precision = dot_settings(x.dtype)
    _linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        y.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y.view(*x.shape[:-1], n)
