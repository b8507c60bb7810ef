"""RMSNorm (residual add folded in), RoPE, the KV store and a gated MLP's SiLU on the CPU, one pass over each row in C++
(`kernels/native/csrc/elementwise.cpp`, built and loaded by `build.py`); the source says why. Float32 and bfloat16
CPU tensors take it (every tensor of a call in one dtype; the store also into an FP8 pool); anything else runs the
torch ops (`kernels/torch/elementwise.py`), which are also its reference."""

from __future__ import annotations

import ctypes

import torch

from batchprefill.kernels.fp8_kv import is_fp8
from batchprefill.kernels.native import build as native
from batchprefill.kernels.torch import elementwise as torch_elementwise

SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the entry points of each op, by element type
SILU = ("silu", "swish")  # the activation names the C++ gated activation takes


def _takes(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """CPU tensors of one dtype the C++ loops have (`dtype`, or the first's) whose last dimension is contiguous."""
    dtype = dtype or tensors[0].dtype
    return dtype in SUFFIXES and all(
        t.dtype == dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


class NativeElementwise:
    def __init__(self, library: ctypes.CDLL):
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        norm_arguments = [pointer, size, pointer, size, pointer, size, size, ctypes.c_float, pointer, pointer,
                          ctypes.c_int]
        rope_arguments = [pointer, size, size, size, pointer, pointer, size, size, pointer, ctypes.c_int]
        self._norm = {dtype: _function(library, f"add_rms_norm_{suffix}", norm_arguments)
                      for dtype, suffix in SUFFIXES.items()}
        self._rope = {dtype: _function(library, f"rope_{suffix}", rope_arguments) for dtype, suffix in SUFFIXES.items()}
        self._silu = {dtype: _function(library, f"silu_and_mul_{suffix}", [pointer, size, size, size, pointer,
                                                                            ctypes.c_int])
                      for dtype, suffix in SUFFIXES.items()}
        self._store = _function(library, "store_kv", [pointer, size, pointer, size, pointer, size, size, pointer,
                                                      pointer])
        self._store_fp8 = {dtype: _function(library, f"store_kv_fp8_{suffix}", [pointer, size, pointer, size, pointer,
                                                                                 size, size, pointer, pointer,
                                                                                 ctypes.c_int])
                           for dtype, suffix in SUFFIXES.items()}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `torch_elementwise.rms_norm`: (norm(x + residual) * weight, x + residual), x itself with no residual."""
        pair = (x,) if residual is None else (x, residual)
        if x.dim() != 2 or not _takes(*pair, weight) or not weight.is_contiguous():
            return torch_elementwise.rms_norm(x, weight, eps, residual)
        rows, cols = x.shape
        normed = torch.empty(rows, cols, dtype=x.dtype)
        total = x if residual is None else torch.empty(rows, cols, dtype=x.dtype)
        self._norm[x.dtype](x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                   0 if residual is None else residual.stride(0), weight.data_ptr(), rows, cols, eps,
                   normed.data_ptr(), None if residual is None else total.data_ptr(), torch.get_num_threads())
        return normed, total

    def rope(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `torch_elementwise.rope`, into new contiguous tensors."""
        if not (_takes(query, key) and _takes(cos_sin, dtype=torch.float32) and cos_sin.is_contiguous()
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            return torch_elementwise.rope(query, key, positions, cos_sin)
        return self._rotated(query, positions, cos_sin), self._rotated(key, positions, cos_sin)

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        tokens, heads, width = x.shape
        out = torch.empty(tokens, heads, width, dtype=x.dtype)
        self._rope[x.dtype](x.data_ptr(), x.stride(0), x.stride(1), heads, positions.data_ptr(), cos_sin.data_ptr(),
                            width, tokens, out.data_ptr(), torch.get_num_threads())
        return out

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """As `torch_elementwise.gated_activation`, SiLU (SwiGLU) rows in one pass; other activations in torch."""
        if activation not in SILU or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _takes(gate_up):
            return torch_elementwise.gated_activation(gate_up, activation)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self._silu[gate_up.dtype](gate_up.data_ptr(), gate_up.stride(0), rows, width, out.data_ptr(),
                                  torch.get_num_threads())
        return out

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """As `torch_elementwise.store_kv`: key and value `[T, Hkv, D]` into the pool at their slots (-1: skipped);
        into an FP8 pool rounded as `fp8.to_cache` rounds."""
        tokens, heads, dim = key.shape
        fp8 = is_fp8(k_cache.dtype) and k_cache.dtype == v_cache.dtype
        pool = (key, value) if fp8 else (key, value, k_cache, v_cache)
        if not (_takes(*pool) and _rows(key) and _rows(value) and k_cache.is_contiguous()
                and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
            return torch_elementwise.store_kv(key, value, k_cache, v_cache, slot_mapping)
        if fp8:
            self._store_fp8[key.dtype](key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                       slot_mapping.data_ptr(), tokens, heads * dim, k_cache.data_ptr(),
                                       v_cache.data_ptr(), int(k_cache.dtype == torch.float8_e5m2))
            return
        size = key.element_size()
        self._store(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
                    slot_mapping.data_ptr(), tokens, heads * dim * size, k_cache.data_ptr(), v_cache.data_ptr())


def _function(library: ctypes.CDLL, name: str, arguments: list) -> ctypes._CFuncPtr:
    function = getattr(library, name)
    function.restype = None
    function.argtypes = arguments
    return function


def _rows(x: torch.Tensor) -> bool:
    """Each token's heads adjacent, so a token is one contiguous row of Hkv x D floats."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def load() -> NativeElementwise | None:
    """The kernels, or None where they are disabled or cannot be built."""
    library = native.library("elementwise")
    return None if library is None else NativeElementwise(library)
