"""The bfloat16 decode kernel's walks on one thread: AMX tile walks against the float32 vector walks, with the pool in
cache and read from memory.

    python benchmarks/cpu/decode_walks.py

Shapes of SmolLM2-135M (9 query heads, 3 KV heads of 64, blocks of 16). Each case is a decode step's attention for
30 layers: "in cache" repeats one layer's pool 30 times, "from memory" walks 30 distinct pools, as a real step does.
The vector walks are the same kernel given float32 queries over the same bfloat16 pool (they widen it and compute in
float32; since 2026-12-04 a set's scores over its prefix are bfloat16 pair products where the CPU has AVX512_BF16,
as every CPU with AMX has); the tile walks get the bfloat16 queries a bfloat16 model hands them (on a CPU without AMX,
the vector walks again). Best of 5, milliseconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_ops import HEADS, decode_batch  # noqa: E402

from batchprefill.kernels.torch.ops import TorchOps  # noqa: E402

CASES = [(9, 9, 448, 1, "9 groups of 9 over 448 shared tokens, 1 own"),
         (9, 9, 448, 48, "9 groups of 9 over 448 shared tokens, 48 own"),
         (81, 1, 16, 1, "81 lone decodes of 17 tokens"), (81, 1, 16, 48, "81 lone decodes of 64 tokens"),
         (81, 1, 16, 112, "81 lone decodes of 128 tokens")]


def best_ms(ops, query, pools, plan) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for keys, values in pools:
            ops.attention(query, keys, values, plan, 0.125)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    ops = TorchOps()
    print("| case | vector walks, in cache | tiles, in cache | vector walks, from memory | tiles, from memory |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for groups, members, prefix, own, name in CASES:
        query, keys, values, meta = decode_batch(groups=groups, members=members, prefix=prefix, own=own)
        distinct = [(keys.bfloat16() + 0.01 * i, values.bfloat16() - 0.01 * i) for i in range(30)]
        repeated = [distinct[0]] * 30
        row = []
        for pools in (repeated, distinct):
            for q in (query.bfloat16().float(), query.bfloat16()):
                plan = ops.plan(meta, pools[0][0], HEADS, q.dtype)
                row.append(best_ms(ops, q, pools, plan))
        print(f"| {name} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")


if __name__ == "__main__":
    main()
