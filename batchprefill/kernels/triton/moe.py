"""Fused mixture-of-experts on Triton: the step's (token, slot) pairs sorted by expert, one grouped launch for
all experts' gate_up + SiLU, one for all experts' down projection times the router weight.

Each expert's rows are padded to whole `BLOCK_M` tiles, so a tile belongs to one expert and reads that
expert's weights once for up to `BLOCK_M` tokens. The sort runs on the device with fixed-size outputs (room
for the worst padding, `pairs + experts * (BLOCK_M - 1)` rows): no host sync, so a decode step that calls
it can still be captured in a CUDA graph. Tiles past the last expert's rows return at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from batchprefill.kernels.experts import ExpertWeights
from batchprefill.kernels.fp8 import FP8, Fp8Weight
from batchprefill.kernels.triton.attention import interpreting


@triton.jit
def _tile_rows(sorted_pairs_ptr, tile, num_pairs, top_k, BLOCK_M: tl.constexpr):
    """The tile's pair indices, whether each row holds a pair (padding rows do not), and its token."""
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    return pairs.to(tl.int64), valid, (pairs // top_k).to(tl.int64)


@triton.jit
def _widened(w, scale_ptr, rows, k0, stride_sn, stride_sk, scale_rows, scale_cols, valid, dtype: tl.constexpr):
    """A tile of FP8 weights `[BLOCK_K, BLOCK_N]` (its columns are weight `rows`) times their scales, rounded to
    `dtype`: the bits the weights dequantized at load would have. The tile's inner range lies in one scale block
    (`scale_cols` is a multiple of BLOCK_K, or the whole row for per-channel scales, whose `stride_sk` is 0)."""
    scale = tl.load(scale_ptr + (rows // scale_rows) * stride_sn + (k0 // scale_cols) * stride_sk, mask=valid,
                    other=0.0)
    widened = w.to(tl.float32) * scale[None, :]
    if dtype == tl.bfloat16:  # rounded to nearest, ties to even, in integer arithmetic: the interpreter's cast
        bits = widened.to(tl.uint32, bitcast=True)  # truncates, a GPU's rounds; rounded first, both are exact
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        widened = bits.to(tl.float32, bitcast=True)
    return widened.to(dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_pairs_ptr, tile_experts_ptr, num_pairs, num_experts, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at, scale_ptr, stride_se, stride_sn, stride_sk, scale_rows, scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """One program: BLOCK_M rows of one expert, BLOCK_N intermediate columns of silu(gate) * up; `FP8`: the
    weights are FP8, widened in registers (`_widened`)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts:  # past the last expert's rows
        return
    pairs, row_valid, tokens = _tile_rows(sorted_pairs_ptr, tile, num_pairs, top_k, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < inter
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        gate_w = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        up_w = tl.load(w_expert + (cols + inter)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if FP8:
            s_expert = scale_ptr + expert.to(tl.int64) * stride_se
            dtype = x_ptr.dtype.element_ty
            gate_w = _widened(gate_w, s_expert, cols, k0, stride_sn, stride_sk, scale_rows, scale_cols, col_valid,
                              dtype)
            up_w = _widened(up_w, s_expert, cols + inter, k0, stride_sn, stride_sk, scale_rows, scale_cols,
                            col_valid, dtype)
        if UPCAST:
            x, gate_w, up_w = x.to(tl.float32), gate_w.to(tl.float32), up_w.to(tl.float32)
        acc_gate = tl.dot(x, gate_w, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, up_w, acc_up, input_precision=DOT_PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + pairs[:, None] * stride_at + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, route_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_pairs, num_experts, top_k,
    hidden, inter, stride_at, stride_we, stride_wn, stride_ot, scale_ptr, stride_se, stride_sn, stride_sk,
    scale_rows, scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """One program: BLOCK_M rows of one expert, BLOCK_N hidden columns of down(act), times the router weight."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= num_experts:
        return
    pairs, row_valid, _ = _tile_rows(sorted_pairs_ptr, tile, num_pairs, top_k, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < inter
        act = tl.load(act_ptr + pairs[:, None] * stride_at + ks[None, :],
                      mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None], mask=k_valid[:, None] & col_valid[None, :],
                    other=0.0)
        if FP8:
            w = _widened(w, scale_ptr + expert.to(tl.int64) * stride_se, cols, k0, stride_sn, stride_sk, scale_rows,
                         scale_cols, col_valid, act_ptr.dtype.element_ty)
        if UPCAST:
            act, w = act.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(act, w, acc, input_precision=DOT_PRECISION)
    route = tl.load(route_ptr + pairs, mask=row_valid, other=0.0)
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], (acc * route[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pairs, tile experts): pair indices `t * K + k` grouped by expert, each expert's run padded to
    whole tiles with the sentinel `T * K`; and each tile's expert, `num_experts` for tiles past the end.

    Sizes depend only on the shapes, and every op stays on the device.
    """
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_tiles = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[padded_starts[sorted_experts] + rank] = order.int()
    tile_starts = torch.arange(num_tiles, device=flat.device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True).int()
    return sorted_pairs, tile_experts


def _block_m(num_pairs: int, num_experts: int, batch_invariant: bool = False) -> int:
    """Rows per tile: small when each expert gets few rows (decode), so padding does not dominate. Batch-invariant
    steps take 32 rows whatever the step (the middle of the three; a GPU has not chosen): on a GPU the tile's row
    count decides how `tl.dot` is laid out, and with it how a row's sums are ordered."""
    if interpreting():
        return 16
    if batch_invariant:
        return 32
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _weights_and_scales(weights: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, tuple]:
    """A stack of expert matrices `[E, N, K]` as the kernels read it: the values, and their scales' pointer,
    strides and block (rows, columns) for `_widened` (the values themselves and zeros for 16-bit weights, which
    do not read them)."""
    data = weights.data if isinstance(weights, Fp8Weight) else weights
    if data.stride(2) != 1:
        raise ValueError("expert weights must be contiguous in their input dimension")
    if not isinstance(weights, Fp8Weight):
        return data, (data, 0, 0, 0, 1, 1)
    scale = weights.scale
    if weights.block is None:  # [E, N]: one scale per row, whatever its column
        return data, (scale, scale.stride(0), scale.stride(1), 0, 1, data.shape[2])
    rows, columns = weights.block
    return data, (scale, scale.stride(0), scale.stride(1), scale.stride(2), rows, columns)


def fused_experts(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """The Triton `Ops.moe`: same contract and result as `torch_experts`. `batch_invariant` fixes the tiles and
    sums each token's experts in slot order (torch's reduction picks its own order from the shape)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs, hidden_size, inter = num_tokens * top_k, hidden.shape[1], experts.intermediate_size
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden.contiguous()
    gate_up, down = experts.stacked()
    block_m = _block_m(num_pairs, experts.num_experts, batch_invariant)
    block_n, block_k = (32, 32) if interpreting() else (64, 64)
    # an FP8 stack's inner tiles stay inside its scale blocks (block widths are powers of two from 16:
    # `multiplies_fp8`), so the gcd is one of them, or the tile itself
    block_k = math.gcd(block_k, *(w.block[1] for w in (gate_up, down) if isinstance(w, Fp8Weight) and w.block))
    gate_up, gate_up_scales = _weights_and_scales(gate_up)
    down, down_scales = _weights_and_scales(down)
    sorted_pairs, tile_experts = sort_by_expert(topk_ids, experts.num_experts, block_m)
    upcast = interpreting()
    precision = "ieee" if upcast or hidden.dtype == torch.float32 else "tf32"
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(tile_experts.numel(), triton.cdiv(inter, block_n))](
        hidden, gate_up, act, sorted_pairs, tile_experts, num_pairs, experts.num_experts, top_k, hidden_size, inter,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), *gate_up_scales,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, DOT_PRECISION=precision,
        FP8=gate_up.dtype == FP8,
    )
    route = topk_weights.to(hidden.dtype).flatten().contiguous()
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(tile_experts.numel(), triton.cdiv(hidden_size, block_n))](
        act, down, route, out, sorted_pairs, tile_experts, num_pairs, experts.num_experts, top_k, hidden_size, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0), *down_scales,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, DOT_PRECISION=precision,
        FP8=down.dtype == FP8,
    )
    per_slot = out.view(num_tokens, top_k, hidden_size)
    if not batch_invariant:
        return per_slot.sum(dim=1)
    total = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    for slot in range(top_k):
        total += per_slot[:, slot]
    return total.to(hidden.dtype)
