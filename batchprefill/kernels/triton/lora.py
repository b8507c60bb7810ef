"""LoRA deltas on Triton: one launch per projection for every adapter of the step (Punica's segmented idea).

The step's tokens come as segments, runs of consecutive tokens of one adapter (`LoraStep.segments`; the order
stage keeps an adapter's rows together, so there are few). A program takes `BLOCK_M` tokens of one segment,
computes their shrink `x A.T` (`[BLOCK_M, rank]`, held in registers: ranks are at most 256) and then its share
of the expand, `N_SPLITS` programs splitting the output columns. Each split recomputes the small shrink rather
than spill it to memory and launch again: the shrink costs `in x rank` per token, the whole delta is a few
percent of the base projection's work, and one launch keeps the per-projection overhead to one launch.
Tokens of the base model are in no segment and are never touched; an adapter that does not target this
projection has rank 0 there, and its programs return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchprefill.kernels.lora import LoraStep, LoraWeights
from batchprefill.kernels.triton.attention import interpreting, jit_unspecialized

MIN_DOT = 16  # tl.dot's smallest tile side


@jit_unspecialized("num_segments")  # a step's runs of one adapter: 1 in one step, 37 in the next
def _lora_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    segments_ptr,
    ranks_ptr,
    num_segments,
    num_adapters,
    in_features,
    out_features,
    stride_xt,
    stride_an,
    stride_ar,
    stride_bn,
    stride_bo,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_M tokens of one segment, its shrink, and 1/N_SPLITS of the expand added into `out`."""
    segment, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(segments_ptr + segment)
    length = tl.load(segments_ptr + num_segments + segment)
    adapter = tl.load(segments_ptr + 2 * num_segments + segment)
    if tile * BLOCK_M >= length:
        return
    if adapter >= num_adapters:  # an adapter index above every one that targets this projection
        return
    rank = tl.load(ranks_ptr + adapter)
    if rank == 0:  # this adapter does not target this projection
        return
    offsets = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offsets < length
    rows = (start + offsets).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_valid = rs < rank
    a_adapter = a_ptr + adapter.to(tl.int64) * stride_an
    b_adapter = b_ptr + adapter.to(tl.int64) * stride_bn
    low = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0
        )
        a = tl.load(
            a_adapter + rs[None, :] * stride_ar + ks[:, None], mask=k_valid[:, None] & r_valid[None, :], other=0.0
        )
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        low = tl.dot(x, a, low, input_precision=DOT_PRECISION)
    if not UPCAST:
        low = low.to(b_ptr.dtype.element_ty)  # the expand's operands in the weights' dtype, as the torch path
    per_split = tl.cdiv(tl.cdiv(out_features, N_SPLITS), BLOCK_N) * BLOCK_N
    first = split * per_split
    last = tl.minimum(first + per_split, out_features)
    for n0 in range(first, last, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_valid = ns < last
        b = tl.load(
            b_adapter + ns[None, :] * stride_bo + rs[:, None], mask=r_valid[:, None] & n_valid[None, :], other=0.0
        )
        if UPCAST:
            b = b.to(tl.float32)
        delta = tl.dot(low, b, input_precision=DOT_PRECISION)
        mask = row_valid[:, None] & n_valid[None, :]
        where = out_ptr + rows[:, None] * stride_ot + ns[None, :]
        y = tl.load(where, mask=mask, other=0.0).to(tl.float32)
        tl.store(where, (y + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(longest: int, batch_invariant: bool = False) -> int:
    """Tokens per program: from the longest segment, so a decode step's 1-token segments do not fill 64-row tiles.
    Batch-invariant steps take 32 whatever the step: on a GPU the tile's row count decides how `tl.dot` is laid
    out, and with it how a row's shrink sums are ordered (the rank and the splits follow the adapters, not the step).
    The interpreter takes the smallest tile."""
    if interpreting():
        return MIN_DOT
    if batch_invariant:
        return 32
    return MIN_DOT if longest <= 16 else 32 if longest <= 64 else 64


def segmented_lora(
    out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, step: LoraStep, batch_invariant: bool = False
) -> None:
    """The Triton `Ops.lora`: same contract and result as `kernels.lora.torch_lora`; `batch_invariant` fixes the
    tile (`_block_m`)."""
    a, b, ranks = weights.stacked()
    x = x.contiguous()
    if out.stride(1) != 1:
        raise ValueError("the projection's output must be contiguous in its columns")
    upcast = interpreting()
    precision = "ieee" if upcast or x.dtype == torch.float32 else "tf32"
    block_m = _block_m(step.longest, batch_invariant)
    block_r = max(MIN_DOT, triton.next_power_of_2(a.shape[1]))
    block_k, block_n = (32, 32) if upcast else (64 if block_r <= 64 else 32, 64)
    splits = 2 if upcast else 8
    num_segments = step.segments.shape[1]
    grid = (num_segments, triton.cdiv(step.longest, block_m), splits)
    _lora_kernel[grid](
        x,
        a,
        b,
        out,
        step.segments,
        ranks,
        num_segments,
        a.shape[0],
        weights.in_features,
        weights.out_features,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        N_SPLITS=splits,
        UPCAST=upcast,
        DOT_PRECISION=precision,
    )
