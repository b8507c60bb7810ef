"""GPU benchmark of the Triton kernels: correctness against torch, measured ceilings, speed against SDPA.

    python benchmarks/gpu.py [--out benchmarks/gpu_results.json]   # one GPU, under 5 minutes
    python benchmarks/gpu.py --smoke --out /tmp/smoke.json          # tiny shapes, CPU interpreter

Shapes are Llama-3-8B-like (32 query heads, 8 KV heads, head dim 128, bf16, 16-token blocks). The smoke
mode runs every step at toy sizes with wall-clock timing, only to prove the script works.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_e2e  # noqa: E402
import gpu_moe  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from batchprefill.kernels.torch_ops import TorchOps  # noqa: E402
from batchprefill.kernels.triton_ops import TritonOps  # noqa: E402
from batchprefill.model.rope import rope_cos_sin  # noqa: E402
from tests.synthetic import random_paged_batch  # noqa: E402

PREFILL_GOAL = 0.8  # Triton prefill speed / flash SDPA speed, on equal work
DECODE_GOAL = 0.7  # fraction of measured copy bandwidth, at contexts of at least DECODE_GOAL_CONTEXT
DECODE_GOAL_CONTEXT = 16384
TOLERANCE = 2e-2  # bf16


@dataclass
class Plan:
    """Model shape and the batches to check and to time."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    checks: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {
        "mixed prefill+decode": [(1000, 300), (0, 513), (700, 1), (2000, 1)],
        "decode split-K": [(5000, 1), (300, 1)],
        "decode 64 seqs": [(700, 1)] * 64,
    })
    ops_settings: dict = field(default_factory=dict)
    # (seq_len, chunk): the chunk is the last `chunk` tokens; chunk == seq_len compares with flash causal
    prefill: list[tuple[int, int]] = field(default_factory=lambda: [
        (1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192),
        (4096, 512), (8192, 2048), (16384, 2048), (32768, 512), (32768, 2048),
    ])
    decode_batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128, 256])
    decode_contexts: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    max_decode_tokens: int = 1 << 20  # 4 GiB of bf16 KV per layer at these shapes, plus SDPA's copy
    copy_bytes: int = 1 << 31
    matmul_size: int = 8192


SMOKE = Plan(
    heads=4, kv_heads=2, head_dim=32,
    checks={"mixed prefill+decode": [(40, 20), (0, 17), (30, 1)], "decode split-K": [(150, 1), (20, 1)]},
    ops_settings=dict(decode_min_segment=32), prefill=[(48, 48), (100, 37)], decode_batches=[1, 3],
    decode_contexts=[100], max_decode_tokens=1 << 10, copy_bytes=1 << 20, matmul_size=64,
)


def check_kernels(plan: Plan, device: torch.device, dtype: torch.dtype) -> None:
    """Every TritonOps kernel against TorchOps; raises if any differs beyond the bf16 tolerance."""
    fast, reference = TritonOps(**plan.ops_settings), TorchOps()
    failures = []

    def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.float() - want.float()).abs().max().item()
        ok = torch.allclose(got.float(), want.float(), atol=TOLERANCE, rtol=TOLERANCE)
        print(f"  {name:<30} max |err| {err:.2e}  {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)

    shape = (plan.heads, plan.kv_heads, plan.head_dim, plan.block_size, dtype, device)
    for seed, (name, specs) in enumerate(plan.checks.items()):
        query, k_cache, v_cache, meta = random_paged_batch(specs, *shape, seed=seed)
        scale = plan.head_dim**-0.5
        compare(f"attention, {name}", fast.attention(query, k_cache, v_cache, meta, scale),
                reference.attention(query, k_cache, v_cache, meta, scale))
        window = max(8, max(sum(spec) for spec in specs) // 3)  # a sliding window shorter than the contexts
        compare(f"attention, {name}, window {window}", fast.attention(query, k_cache, v_cache, meta, scale, window),
                reference.attention(query, k_cache, v_cache, meta, scale, window))

    query, k_cache, v_cache, meta = random_paged_batch(next(iter(plan.checks.values())), *shape)
    tokens = query.shape[0]
    key, value = (torch.randn(tokens, plan.kv_heads, plan.head_dim, dtype=dtype, device=device)
                  for _ in range(2))
    slots = meta.slot_mapping.clone()
    slots[0] = -1
    caches = [torch.zeros_like(k_cache) for _ in range(4)]
    fast.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    compare("store_kv k", caches[0], caches[2])
    compare("store_kv v", caches[1], caches[3])

    hidden = plan.heads * plan.head_dim
    x, residual = (torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    for got, want, part in zip(fast.rms_norm(x, weight, 1e-5, residual),
                               reference.rms_norm(x, weight, 1e-5, residual), ("normed", "residual"), strict=True):
        compare(f"rms_norm {part}", got, want)

    key = torch.randn(tokens, plan.kv_heads, plan.head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    cos_sin = rope_cos_sin(plan.head_dim, 4096, 500000.0).to(device)
    for got, want, part in zip(fast.rope(query, key, positions, cos_sin),
                               reference.rope(query, key, positions, cos_sin), ("q", "k"), strict=True):
        compare(f"rope {part}", got, want)
    if failures:
        raise AssertionError(f"Triton kernels differ from torch: {failures}")


def bench(fn: Callable[[], object], device: torch.device, graph: bool = False) -> float:
    """Median milliseconds per call; `graph` replays a CUDA graph so launch overhead does not count.
    Off the GPU (smoke mode) one wall-clock call, which only exercises the code."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_ceilings(plan: Plan, device: torch.device) -> dict[str, float]:
    """What this device really does: device-to-device copy GB/s (read + write) and bf16 matmul TFLOP/s."""
    src = torch.empty(plan.copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src), device)
    n = plan.matmul_size
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    matmul_ms = bench(lambda: a @ b, device)
    return {"copy_gbps": 2 * plan.copy_bytes / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / matmul_ms / 1e9}


def bench_prefill(plan: Plan, device: torch.device, dtype: torch.dtype, ceilings: dict) -> list[dict]:
    rows = []
    for seq_len, chunk in plan.prefill:
        shape = (plan.heads, plan.kv_heads, plan.head_dim, plan.block_size, dtype, device)
        query, k_cache, v_cache, meta = random_paged_batch([(seq_len - chunk, chunk)], *shape)
        ops, scale = TritonOps(**plan.ops_settings), plan.head_dim**-0.5
        triton_ms = bench(partial(ops.attention, query, k_cache, v_cache, meta, scale), device)

        # The same work on contiguous tensors, KV heads expanded: flash when the chunk is the whole
        # sequence, else a bottom-right-aligned causal mask (the chunk sits at the end of its context).
        q = torch.randn(1, plan.heads, chunk, plan.head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(1, plan.heads, seq_len, plan.head_dim, dtype=dtype, device=device) for _ in range(2))
        square = chunk == seq_len
        mask = None if square else causal_lower_right(chunk, seq_len)
        sdpa_ms = bench(partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=square), device)

        pairs = chunk * (seq_len - chunk) + chunk * (chunk + 1) // 2
        tflops = 4 * plan.heads * plan.head_dim * pairs / triton_ms / 1e9
        rows.append({
            "seq_len": seq_len, "chunk": chunk, "triton_ms": triton_ms, "tflops": tflops,
            "frac_matmul_peak": tflops / ceilings["matmul_tflops"], "sdpa": "flash causal" if square else
            "causal_lower_right", "sdpa_ms": sdpa_ms, "speed_vs_sdpa": sdpa_ms / triton_ms,
        })
        del query, k_cache, v_cache, q, k, v
    return rows


def bench_decode(plan: Plan, device: torch.device, dtype: torch.dtype, ceilings: dict) -> list[dict]:
    rows = []
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            if batch * context > plan.max_decode_tokens:
                continue
            shape = (plan.heads, plan.kv_heads, plan.head_dim, plan.block_size, dtype, device)
            query, k_cache, v_cache, meta = random_paged_batch([(context - 1, 1)] * batch, *shape)
            ops, scale = TritonOps(**plan.ops_settings), plan.head_dim**-0.5
            triton_ms = bench(partial(ops.attention, query, k_cache, v_cache, meta, scale), device, graph=True)
            q = query.unsqueeze(2)  # [B, Hq, 1, D]
            k, v = (torch.randn(batch, plan.kv_heads, context, plan.head_dim, dtype=dtype, device=device)
                    for _ in range(2))
            sdpa_ms = bench(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True), device, graph=True)
            kv_bytes = 2 * batch * context * plan.kv_heads * plan.head_dim * k_cache.element_size()
            gbps = kv_bytes / triton_ms / 1e6
            rows.append({
                "batch": batch, "context": context, "segments": ops.decode_split(meta, plan.kv_heads)[1],
                "triton_ms": triton_ms, "gbps": gbps, "frac_copy_bw": gbps / ceilings["copy_gbps"],
                "sdpa_ms": sdpa_ms, "speed_vs_sdpa": sdpa_ms / triton_ms,
            })
            del query, k_cache, v_cache, q, k, v
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    columns = list(rows[0])
    print("  ".join(f"{c:>18}" for c in columns))
    for row in rows:
        print("  ".join(f"{v:>18.4g}" if isinstance(v, float) else f"{v!s:>18}" for v in row.values()))


def judge_goals(prefill: list[dict], decode: list[dict]) -> dict[str, dict]:
    flash_rows = [r["speed_vs_sdpa"] for r in prefill if r["sdpa"] == "flash causal"]
    long_rows = [r["frac_copy_bw"] for r in decode if r["context"] >= DECODE_GOAL_CONTEXT]
    goals = {
        f"prefill >= {PREFILL_GOAL}x flash SDPA (worst square row)": min(flash_rows, default=float("nan")),
        f"decode >= {DECODE_GOAL:.0%} of copy bandwidth (worst row, context >= {DECODE_GOAL_CONTEXT})":
            min(long_rows, default=float("nan")),
    }
    thresholds = (PREFILL_GOAL, DECODE_GOAL)
    result = {}
    print()
    for (goal, value), threshold in zip(goals.items(), thresholds, strict=True):
        met = value >= threshold  # False when no row qualifies (nan)
        result[goal] = {"value": value, "met": met}
        print(f"goal {goal}: {value:.3f} -> {'MET' if met else 'NOT MET'}")
    return result


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            for table in ("prefill", "decode"):
                writer = csv.DictWriter(f, fieldnames=["table", *results[table][0]])
                writer.writeheader()
                writer.writerows({"table": table, **row} for row in results[table])
    else:
        path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu_results.json"),
                        help="results file: .json, or .csv for the two tables")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1, to test this script")
    args = parser.parse_args()

    if args.smoke:
        plan, device = SMOKE, torch.device("cpu")
    elif torch.cuda.is_available():
        plan, device = Plan(), torch.device("cuda")
    else:
        sys.exit("no GPU: run with --smoke to test the script on the CPU")
    dtype = torch.bfloat16
    start = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}")

    print("correctness against TorchOps (bf16):")
    check_kernels(plan, device, dtype)
    ceilings = measure_ceilings(plan, device)
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    prefill = bench_prefill(plan, device, dtype, ceilings)
    print_table("prefill attention (one sequence, chunk at the end of its context)", prefill)
    decode = bench_decode(plan, device, dtype, ceilings)
    print_table("decode attention (CUDA graph replay; GB/s counts K and V bytes read)", decode)
    goals = judge_goals(prefill, decode)
    moe = gpu_moe.run(args.smoke, device, bench)
    print_table("fused MoE against the per-expert torch loop (bf16)", moe)
    end_to_end = gpu_e2e.run(args.smoke, device)
    write_results(args.out, {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"heads": plan.heads, "kv_heads": plan.kv_heads, "head_dim": plan.head_dim,
                  "block_size": plan.block_size, "dtype": str(dtype)},
        "ceilings": ceilings, "prefill": prefill, "decode": decode, "goals": goals, "end_to_end": end_to_end,
        "moe": moe,
    })
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
