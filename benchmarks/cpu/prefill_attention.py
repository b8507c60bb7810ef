"""Prefill attention on the CPU in float32 and bfloat16: torch's fused kernel, one thread, causal chunks.

    python benchmarks/cpu/prefill_attention.py

Why: the bfloat16 issue asked for prefill attention on the matrix units too. A chunk's queries against its keys are
the same fused call on the torch path (`kernels/torch/ops.py`); this measures whether torch's kernel already runs
bfloat16 on the tiles: a rate above float32's peak on one core (about 190 GFLOP/s with AVX-512 FMAs at 3 GHz) says
it does. FLOPs are counted for the causal half (2 x L^2 x D x heads).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def best_ms(fn, repeat: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    print("| queries = keys | dtype | ms | GFLOP/s |\n| ---: | --- | ---: | ---: |")
    for length in (512, 2048):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, 9, length, 64).to(dtype) for _ in range(3))
            ms = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125))  # noqa: B023
            rate = 9 * length**2 * 64 * 2 / ms / 1e6
            print(f"| {length} | {str(dtype).removeprefix('torch.')} | {ms:.2f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
