"""Prefill chunks on the CPU path: walked by the C++ kernel against the fused calls they used to take.

    python benchmarks/cpu/chunk_routes.py                     # SmolLM2's heads, 2 threads
    python benchmarks/cpu/chunk_routes.py --heads 32/8/128    # Llama-3-8B's
    python benchmarks/cpu/chunk_routes.py --threads 1

Each case is one step's prefill chunks (cached tokens, queries) over a pool of scattered 16-token blocks, through
`TorchOps.attention` planned two ways, timed in turn (wall time, median of `--repeat`): the kernel's walks (every
chunk's rows in one call, `paged_decode._chunk_sets`), and the routes the torch path takes without them (group
attention's padded calls for short chunks, torch's fused kernel for long ones: `TorchOps(native=False)`). The
largest difference between the two outputs is printed beside them. GFLOP/s count the causal products, 4 x queries x
(cached + (queries + 1) / 2) x head size x query heads.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch

from batchprefill import malloc
from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.torch import ops as torch_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads
import workloads  # noqa: E402
from cpu_ops import median_ms  # noqa: E402

BLOCK = 16
CASES = [[(0, 32)], [(0, 64)], [(0, 128)], [(0, 256)], [(0, 512)], [(0, 1024)], [(0, 2048)], [(64, 384)],
         [(448, 512)], [(1024, 1024)], [(0, 64)] * 8, [(0, 200)] * 2, [(448, 48)] * 9]
POOLS = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
         "fp8": (torch.bfloat16, torch.float8_e4m3fn)}  # (queries, pool)


def step(chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, queries: torch.dtype,
         pool: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    generator = torch.Generator().manual_seed(len(chunks))
    tables, q_lens, seq_lens, used = [], [], [], 0
    for cached, count in chunks:
        blocks = cdiv(cached + count, BLOCK)
        tables.append(list(range(used, used + blocks)))
        used += blocks
        q_lens.append(count)
        seq_lens.append(cached + count)
    scatter = torch.randperm(used, generator=generator).tolist()
    tables = [[scatter[b] for b in table] for table in tables]
    k_cache, v_cache = (torch.randn(used, BLOCK, kv_heads, dim, generator=generator).to(pool) for _ in range(2))
    width = max(map(len, tables))
    meta = AttentionMetadata(torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                             torch.zeros(sum(q_lens), dtype=torch.int64), q_lens, seq_lens)
    return torch.randn(sum(q_lens), heads, dim, generator=generator).to(queries), k_cache, v_cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="9/3/64", help="query heads / KV heads / head size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pools", default=",".join(POOLS), help="comma list of " + ", ".join(POOLS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    malloc.keep_freed_memory()  # as a job does (build_engine): without it, buffers above glibc's threshold are mapped
    torch.set_num_threads(args.threads)  # afresh each call, which made some walks 3-5x slower here
    heads, kv_heads, dim = map(int, args.heads.split("/"))
    ops = torch_ops.TorchOps()
    fused_ops = torch_ops.TorchOps(native=False)  # the routes without the kernel: group attention, or alone
    rows = []
    print(f"{workloads.cpu_model()}, {args.threads} threads, heads {args.heads}")
    print("| pool | chunks (cached, queries) | fused routes ms | walked ms | walked / fused | GFLOP/s fused, walked "
          "| largest difference |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.pools.split(","):
        queries, pool = POOLS[name]
        for chunks in CASES:
            query, k_cache, v_cache, meta = step(chunks, heads, kv_heads, dim, queries, pool)
            walked = ops.plan(meta, k_cache, heads, queries)
            fused = fused_ops.plan(meta, k_cache, heads, queries)
            if walked.plan.alone or walked.plan.batches:
                raise SystemExit("the kernel's walks do not take these chunks here (no kernel, or the AMX tile walks)")
            outputs = {}
            times = {}
            for label, backend, plan in (("fused", fused_ops, fused), ("walked", ops, walked)):
                call = functools.partial(backend.attention, query, k_cache, v_cache, plan, dim**-0.5)
                outputs[label] = call().float()
                times[label] = median_ms(call, args.repeat)
            flops = sum(4 * count * (cached + (count + 1) / 2) * dim * heads for cached, count in chunks)
            rates = [flops / times[label] / 1e6 for label in ("fused", "walked")]
            difference = float((outputs["fused"] - outputs["walked"]).abs().max())
            label = f"{len(chunks)} x {chunks[0]}" if len(chunks) > 1 else str(chunks[0])
            print(f"| {name} | {label} | {times['fused']:.2f} | {times['walked']:.2f} | "
                  f"{times['walked'] / times['fused']:.2f} | {rates[0]:.0f}, {rates[1]:.0f} | {difference:.1e} |",
                  flush=True)
            rows.append({"pool": name, "chunks": chunks, "fused_ms": times["fused"], "walked_ms": times["walked"],
                         "difference": difference})
    if args.out:
        args.out.write_text(json.dumps({"cpu": workloads.cpu_model(), "threads": args.threads, "heads": args.heads,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
