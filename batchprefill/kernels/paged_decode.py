"""Decode attention read in place from the paged KV pool: a small C++ kernel (`csrc/paged_decode.cpp`, built and
loaded by `native.py`).

Why: on the CPU a decode's own blocks were gathered into a padded copy (`index_select`) before a fused call,
per layer and step. With long answers that copy is most of the step: at 80 decodes with 450 own tokens each
(SmolLM2-135M, float32, 2 threads) the gather took 440 ms and the fused call on the copy 250 ms of a 1,270 ms
step. The kernel walks each decode's block list and keeps an online softmax, reading every key and value once
where it lies (`benchmarks/cpu_ops.py` has the side-by-side figure).
"""

from __future__ import annotations

import ctypes

import torch

from batchprefill.kernels import native

_ENTRY_POINTS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


class PagedDecode:
    """The loaded kernel: `attend` for every KV dtype it has an entry point for."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in _ENTRY_POINTS.items():
            function = getattr(library, name)
            function.restype = None
            function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float] + \
                [ctypes.c_void_p] * 2 + [ctypes.c_int]
            self._functions[dtype] = function

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each item's query rows `[items, Hkv, rows, D]` against the first `lens[i]` tokens of its blocks
        `[items, width]` (int64): the attention `[items, Hkv, rows, D]` and its log-sum-exp `[items, Hkv, rows]`,
        both float32; an item with no token gets zeros and -inf."""
        items, kv_heads, rows, dim = query.shape
        query = query.to(torch.float32).contiguous()
        blocks, lens = blocks.contiguous(), lens.contiguous()
        out = torch.empty_like(query)
        lse = torch.empty(items, kv_heads, rows, dtype=torch.float32)
        self._functions[k_cache.dtype](
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), lens.data_ptr(),
            items, blocks.shape[1], k_cache.shape[1], kv_heads, rows, dim, scale, out.data_ptr(), lse.data_ptr(),
            torch.get_num_threads())
        return out, lse


def load() -> PagedDecode | None:
    """The kernel, or None where it is disabled or cannot be built."""
    library = native.library("paged_decode")
    return None if library is None else PagedDecode(library)
