"""Per-token kernels: KV cache writes, fused residual add + RMSNorm, rotate-half RoPE, a gated MLP's activation.

Each program handles one token (all its heads, or its whole hidden vector; a slice of its MLP row), so one launch
covers the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchprefill.kernels.fp8_kv import is_fp8


@triton.jit
def _fp8_codes(x, MANTISSA: tl.constexpr):
    """float32 `x` as FP8 bytes (kernels/fp8.py; MANTISSA 3: e4m3fn, 2: e5m2), rounded to nearest even and saturated
    as the torch and C++ stores round, in integer steps: Triton's own float-to-FP8 cast is the GPU's on a GPU but
    its interpreter's elsewhere, which loses the exponent's carry (1.9375 became 1.0 in e4m3). Normal results round
    the float's bits; below the smallest normal the step is fixed, so the value over it is rounded (adding and
    subtracting 2^23 rounds a float32 below 2^22 to an integer, to even)."""
    BIAS: tl.constexpr = 7 if MANTISSA == 3 else 15
    DROPPED: tl.constexpr = 23 - MANTISSA
    LARGEST_BITS: tl.constexpr = 0x43E00000 if MANTISSA == 3 else 0x47600000  # 448.0, 57344.0
    LARGEST_CODE: tl.constexpr = 0x7E if MANTISSA == 3 else 0x7B
    SUBNORMAL_SCALE: tl.constexpr = 512.0 if MANTISSA == 3 else 65536.0  # 2^(bias - 1 + mantissa)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    rounded = magnitude + ((1 << (DROPPED - 1)) - 1) + ((magnitude >> DROPPED) & 1)
    normal = (rounded >> DROPPED) - ((127 - BIAS) << MANTISSA)
    subnormal = ((tl.minimum(tl.abs(x), 1.0) * SUBNORMAL_SCALE + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(magnitude < (128 - BIAS) << 23, subnormal, normal)
    code = tl.where(magnitude >= LARGEST_BITS, LARGEST_CODE, code)
    return (sign | code).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MANTISSA: tl.constexpr,
):
    """FP8_MANTISSA 0: the pool holds the cache dtype; 3 or 2: an e4m3fn or e5m2 pool, passed as its bytes."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    live_heads = tl.where(slot >= 0, num_heads, 0)  # slot -1: a token with no cache slot
    mask = (heads < live_heads) & (dims < head_dim)
    cache_offs = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    cache_offs += heads * stride_ch + dims * stride_cd
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    if FP8_MANTISSA > 0:
        tl.store(k_cache_ptr + cache_offs, _fp8_codes(key.to(tl.float32), FP8_MANTISSA), mask=mask)
        tl.store(v_cache_ptr + cache_offs, _fp8_codes(value.to(tl.float32), FP8_MANTISSA), mask=mask)
    else:
        tl.store(k_cache_ptr + cache_offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden, eps,
    stride_x, stride_r, stride_o, stride_n,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to x's dtype before normalizing, as the unfused `x + residual` does.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_n + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x32 * rstd * weight).to(x.dtype), mask=mask)


@triton.jit
def _rotate(src_ptr, dst_ptr, cos, sin, num_heads, half, stride_sh, stride_dh,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate-half one token's heads: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = src_ptr + heads * stride_sh + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out = dst_ptr + heads * stride_dh + dims
    tl.store(out, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(out + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, num_q_heads, num_k_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_table,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    table = cos_sin_ptr + position * stride_table + dims
    cos = tl.load(table, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(table + half, mask=dims < half, other=0.0).to(tl.float32)
    _rotate(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, cos, sin, num_q_heads, half,
            stride_qh, stride_qoh, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, cos, sin, num_k_heads, half,
            stride_kh, stride_koh, BLOCK_HK, BLOCK_HALF)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    mantissa = 0
    if is_fp8(k_cache.dtype):
        mantissa = 3 if k_cache.dtype == torch.float8_e4m3fn else 2
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), FP8_MANTISSA=mantissa,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else x
    if x2.shape[0] == 0:
        return out, new_residual
    r2 = _rows(residual) if residual is not None else x2
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, new_residual, hidden, eps,
        x2.stride(0), r2.stride(0), hidden, hidden,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual


def rope(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = query.shape
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    if num_tokens == 0:
        return q_out, k_out
    query, key, cos_sin = _unit_last_stride(query), _unit_last_stride(key), _unit_last_stride(cos_sin)
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin, num_q_heads, key.shape[1], half,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view (rows, hidden) with unit stride along hidden."""
    return _unit_last_stride(t).reshape(-1, t.shape[-1])


# The gated activations by kernel code (transformers' names, kernels/torch/elementwise.ACTIVATIONS).
GATED_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu": 2}
GATED_BLOCK = 1024  # columns of one row per program


@triton.jit
def _gated_activation_kernel(gate_up_ptr, out_ptr, width, stride_in, stride_out, ACTIVATION: tl.constexpr,
                             BLOCK: tl.constexpr):
    """act(gate) * up for BLOCK columns of one row, in float32, rounded once; ACTIVATION 0: SiLU, 1: tanh GELU,
    2: erf GELU."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:  # tanh(y) as 1 - 2 / (1 + e^2y): exact at both ends, where e^2y is 0 or inf
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * inner)))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """As kernels/torch/elementwise.py's: one launch reads gate and up once and writes the product, where torch's
    two ops write the activation and read it back (at Llama-3.2-1B's 8,192 a 1,024-row decode step moves 48 MB a
    layer instead of 80)."""
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _gated_activation_kernel[(rows, triton.cdiv(width, GATED_BLOCK))](
            gate_up, out, width, gate_up.stride(0), out.stride(0), GATED_ACTIVATIONS[activation], GATED_BLOCK)
    return out
