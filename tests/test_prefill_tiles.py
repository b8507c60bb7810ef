"""The prefill kernel's launch on Hopper: long chunks take the measured tile table (kernels/triton/ops.py
`HOPPER_PREFILL_TILES`, from benchmarks/gpu/gpu_prefill_tiles.py on the H200), by head size and by whether a cached
context comes before them."""

from __future__ import annotations

import torch

from batchprefill.kernels.triton import attention as triton_attention
from batchprefill.kernels.triton import ops as triton_ops
from batchprefill.kernels.triton.ops import TritonOps
from tests.synthetic import random_paged_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 16  # GQA 3:1


def test_long_16_bit_chunks_on_hopper_take_the_table_row_of_their_kind(monkeypatch) -> None:
    """What an H200 would launch (the interpreter always takes 64-row tiles): chunks of 512 after 600 cached tokens
    take the after-cached row, chunks from scratch the from-scratch row; a 100-token chunk and fp32 the default."""
    for module in (triton_ops, triton_attention):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(triton_ops, "_hopper", lambda device: True)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # fp32 dots as TF32, no warning
    monkeypatch.setattr(triton_ops, "HOPPER_PREFILL_TILES", {(32, True): (64, 128, 8, 4), (32, False): (128, 32, 4, 2)})
    launches = []
    monkeypatch.setattr(triton_ops, "prefill_attention", lambda *args: launches.append(args[9:13]))
    for specs, dtype, want in (([(600, 512), (0, 700)], torch.bfloat16, (64, 128, 8, 4)),
                               ([(0, 700), (0, 600)], torch.bfloat16, (128, 32, 4, 2)),
                               ([(600, 100)], torch.bfloat16, (64, 64, 4, 3)),
                               ([(600, 512)], torch.float32, (128, 64, 4, 3))):
        query, k_cache, v_cache, meta = random_paged_batch(specs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype)
        TritonOps().attention(query, k_cache, v_cache, meta, 0.2)
        assert launches.pop() == want
