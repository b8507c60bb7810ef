"""Chunks with nothing cached before them, through the flash attention torch ships instead of the prefill kernel.

A chunk whose `seq_len` equals its `query_len` attends only to keys computed in this very step: its K and V are
rows of the step's fresh keys and values, so flash attention takes them with no gather from the pool's blocks.
Why: on the H200 the Triton prefill kernel ran such chunks at 0.45-0.53x of flash SDPA (1k-8k tokens, issue 38),
while the flash kernel is the baseline itself.

On a GPU one flash call serves every such chunk of the step (cumulative lengths, GQA heads read in the kernel):
torch's `varlen_attn`, or where it takes no `enable_gqa` (2.10) the ATen flash op it wraps (`varlen_attention`).
Off the GPU (the interpreter's tests), one causal `scaled_dot_product_attention` per chunk.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class FreshChunks:
    """Where a step's from-scratch chunks sit in the flat batch, packed one after another."""

    bounds: list[int]  # host: cumulative lengths of the packed chunks, [chunks + 1], from 0
    cu_seqlens: torch.Tensor  # the same on the device, int32
    rows: torch.Tensor | None  # [bounds[-1]] int32 flat-batch rows of the packed tokens; None: one contiguous range
    first_row: int  # the range's first row when `rows` is None
    longest: int  # tokens in the longest chunk: a window at least this long hides none of their keys


def fresh_layout(query_lens: np.ndarray, fresh: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(cumulative lengths, rows or None, first row) of the sequences `fresh` (ascending) of a step whose
    sequences own `query_lens` rows each, in order. Rows come back only when the chunks are not one range."""
    starts = np.concatenate([[0], np.cumsum(query_lens)])[fresh]
    lens = query_lens[fresh]
    bounds = np.concatenate([[0], np.cumsum(lens)])
    if starts[-1] + lens[-1] - starts[0] == bounds[-1]:  # neighbours in the batch: a slice, no gather
        return bounds, None, int(starts[0])
    return bounds, np.repeat(starts - bounds[:-1], lens) + np.arange(bounds[-1]), 0


def can_route(k_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether fresh rows may replace the pool: they must equal what the pool holds (a cache of another dtype, or a
    quantized one, keeps the prefill kernel, which reads it), and on a GPU the flash kernel must take the device, the
    dtype and the head size (fp32 stays on the Triton kernel's TF32 dots)."""
    if k_cache.dtype != dtype:
        return False
    if k_cache.device.type != "cuda":
        return True
    head_dim = k_cache.shape[3]
    return dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM and _ampere_or_later(
        k_cache.device)


@functools.cache
def _ampere_or_later(device: torch.device) -> bool:
    """torch's flash kernels need sm80 or later."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                 chunks: FreshChunks, scale: float) -> None:
    """Causal attention of each fresh chunk over itself, written into its rows of `out` `[T, Hq, D]`."""
    if chunks.rows is None:
        span = slice(chunks.first_row, chunks.first_row + chunks.bounds[-1])
        q, k, v = query[span], key[span], value[span]
    else:
        q, k, v = (t.index_select(0, chunks.rows) for t in (query, key, value))
    result = out[span] if chunks.rows is None else torch.empty_like(q)  # a slice of `out` is written in place
    varlen = varlen_attention(q.device.type)
    if varlen is not None:
        q, k, v = (t.contiguous() for t in (q, k, v))
        lens, longest = chunks.cu_seqlens, chunks.longest
        result.copy_(varlen(q, k, v, lens, lens, longest, longest, scale=scale, window_size=(-1, 0), enable_gqa=True))
    else:
        for start, end in pairwise(chunks.bounds):
            one = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, L, D]: torch's fused kernels
            attended = F.scaled_dot_product_attention(*one, is_causal=True, scale=scale, enable_gqa=True)
            result[start:end] = attended[0].transpose(0, 1)
    if chunks.rows is not None:
        out[chunks.rows] = result


@functools.cache
def varlen_attention(device_type: str) -> Callable | None:
    """One flash call for all chunks on a GPU: torch's `varlen_attn` where it takes a scale, a causal window and GQA
    as keywords (torch 2.12 and later), else the ATen flash op it wraps, which reads GQA heads natively (2.10's
    `varlen_attn` has no `enable_gqa`, and some builds send it to cuDNN); None off the GPU or where neither
    exists. benchmarks/gpu_prefill_tiles.py prints which one a device runs."""
    if device_type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn

        if {"scale", "window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters):
            return varlen_attn
    except ImportError:
        pass
    return _aten_flash_varlen if hasattr(torch.ops.aten, "_flash_attention_forward") else None


def _aten_flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                       cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float, window_size: tuple[int, int],
                       enable_gqa: bool) -> torch.Tensor:
    """`varlen_attn`'s causal call on ATen's flash forward (the keywords it ignores are what this module passes)."""
    return torch.ops.aten._flash_attention_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, True,
                                                   False, scale=scale)[0]
