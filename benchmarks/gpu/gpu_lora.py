"""The segmented Triton LoRA kernel against the torch grouped path on a GPU, and against the base projection.

    python benchmarks/gpu/gpu_lora.py                  # on a CUDA machine: checks, then times, bf16
    TRITON_INTERPRET=1 python benchmarks/gpu/gpu_lora.py --smoke   # tiny shapes on the CPU interpreter

A Llama-3-8B QKV projection (4096 in; 4096 + 1024 + 1024 out) under 4 adapters of rank 16 on q, k and v, the
step's tokens split evenly among the adapters (the order stage keeps each adapter's rows together), at decode
and prefill token counts. Each row first checks the kernel's sum against `torch_lora` (bf16: within 2e-2 of the
largest value), then times the kernel, the torch path and the base matmul.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import numpy as np
import torch

from batchprefill.kernels.lora import AdapterDelta, LoraPart, LoraStep, LoraWeights, torch_lora
from batchprefill.kernels.triton.lora import segmented_lora

TOLERANCE = 2e-2


def weights(
    hidden: int, q: int, kv: int, rank: int, adapters: int, dtype: torch.dtype, device: torch.device
) -> LoraWeights:
    gen = torch.Generator(device=device).manual_seed(0)
    bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]

    def rand(*shape: int) -> torch.Tensor:
        return (0.05 * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    deltas = {
        i: AdapterDelta(
            rand(3 * rank, hidden),
            [LoraPart(lo, hi, p * rank, (p + 1) * rank, rand(hi - lo, rank)) for p, (lo, hi) in enumerate(bounds)],
        )
        for i in range(1, adapters + 1)
    }
    return LoraWeights(hidden, q + 2 * kv, deltas)


def timed(fn, repeats: int) -> float:
    """Milliseconds per call, by CUDA events (the CPU clock under --smoke)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / repeats
    import time

    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) * 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, q, kv, tokens, repeats = (
        (64, 32, 16, (4, 37), 1) if args.smoke else (4096, 4096, 1024, (4, 16, 256, 2048), 20)
    )
    dtype = torch.float32 if args.smoke else torch.bfloat16
    lora = weights(hidden, q, kv, 16, 4, dtype, device)
    base = (0.02 * torch.randn(q + 2 * kv, hidden, device=device)).to(dtype)
    rows = []
    for count in tokens:
        adapters = np.repeat(np.arange(1, 5, dtype=np.int32), -(-count // 4))[:count]
        step = LoraStep.of(adapters, device)
        x = torch.randn(count, hidden, device=device).to(dtype)
        out = x @ base.t()
        want, got = out.clone(), out.clone()
        torch_lora(want, x, lora, step)
        segmented_lora(got, x, lora, step)
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1.0)).item()
        rows.append(
            {
                "tokens": count,
                "max_error": error,
                "ok": error < TOLERANCE,
                "kernel_ms": timed(partial(segmented_lora, out, x, lora, step), repeats),
                "torch_ms": timed(partial(torch_lora, out, x, lora, step), repeats),
                "base_ms": timed(partial(torch.matmul, x, base.t()), repeats),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": str(device), "rows": rows}, handle, indent=1)
    if not all(row["ok"] for row in rows):
        raise SystemExit("the segmented kernel differs from the torch path")


if __name__ == "__main__":
    main()
