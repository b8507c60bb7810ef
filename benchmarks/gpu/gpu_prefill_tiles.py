"""Prefill tiles for Hopper: every candidate launch of the Triton prefill kernel against flash SDPA, and torch's
own flash kernels on the same chunks read straight from the step's rows (`routed`: from scratch, no gather) or from
a copy of the context gathered out of the pool (`gathered context`: after a cached context). On the H200 both lost
to the kernel's best tiles (routed 0.42-0.61x SDPA against 0.56-0.76x on the same cases; gathered 0.88-1.35x
against 0.74-1.62x, ahead in one case of eight), so the engine keeps every chunk on the kernel; the rows stay here to
measure that again on another device or torch.

    python benchmarks/gpu/gpu_prefill_tiles.py [--out benchmarks/results/gpu_prefill_tiles.json]  # one H200: under 90 s
    python benchmarks/gpu/gpu_prefill_tiles.py --smoke --out /tmp/tiles.json                # CPU interpreter, seconds

For Llama-3-8B's heads (32 query, 8 KV, head_dim 128) and Llama-3.2-1B's (32, 8, 64), one sequence per case: chunks
after a cached context (context/chunk 4096/512, 8192/2048, 16384/2048, 32768/2048) and from scratch (1024 to 8192
tokens, and a step of 8 prompts of 1024), each candidate (block_m 64/128, block_n 32/64/128, warps 4/8, stages
2/3/4) timed against SDPA on the same work (flash causal when the chunk is its whole sequence, else
`causal_lower_right`, as benchmarks/gpu/gpu.py times it). Candidates are compiled first, in parallel processes (Triton
keeps them in its disk cache); one that fails to compile or to launch (shared memory) is recorded with the reason.
Each timing is a median of a few calls, L2 flushed before each. The best candidate per (head_dim, kind) by the
geometric mean of its speed against SDPA is printed as the dict literal for kernels/triton/ops.py's
`HOPPER_PREFILL_TILES`.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from batchprefill.kernels.triton.attention import prefill_attention  # noqa: E402
from batchprefill.kernels.triton.ops import HOPPER_PREFILL_TILES, TritonOps  # noqa: E402
from tests.synthetic import random_paged_batch  # noqa: E402

L2_FLUSH_BYTES = 256 << 20  # H200's L2 is 50 MiB
BLOCK_SIZE = 16
ROUTED_TOLERANCE = 2e-2  # bf16: the routed path against the prefill kernel on the same batch
Config = tuple[int, int, int, int]  # (block_m, block_n, num_warps, num_stages), as HOPPER_PREFILL_TILES holds them


@dataclass(frozen=True)
class Case:
    """`count` sequences of `seq_len` tokens each, of which the last `chunk` are this step's queries."""

    seq_len: int
    chunk: int
    count: int = 1

    @property
    def after_cached(self) -> bool:
        return self.chunk < self.seq_len

    @property
    def pairs(self) -> int:
        return self.count * (self.chunk * (self.seq_len - self.chunk) + self.chunk * (self.chunk + 1) // 2)


@dataclass(frozen=True)
class Plan:
    shapes: dict[str, tuple[int, int, int]]  # name -> (query heads, KV heads, head_dim)
    cases: list[Case]
    configs: list[Config]
    reps: int
    budget_s: float  # candidates left when this is spent are recorded as skipped


FULL = Plan(
    shapes={"llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)},
    cases=[Case(4096, 512), Case(8192, 2048), Case(16384, 2048), Case(32768, 2048),
           Case(1024, 1024), Case(2048, 2048), Case(4096, 4096), Case(8192, 8192), Case(1024, 1024, 8)],
    configs=list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))),
    reps=3, budget_s=80.0,
)
SMOKE = Plan(shapes={"tiny": (4, 2, 32)}, cases=[Case(48, 16), Case(32, 32)],
             configs=[(32, 32, 4, 2), (64, 32, 4, 2)], reps=1, budget_s=60.0)


class Timer:
    """Median milliseconds of `reps` calls after one warm-up, L2 flushed before each, CUDA events around each;
    off the GPU one wall-clock call, which only exercises the code."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.flush is None:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return float(np.median([start.elapsed_time(end) for start, end in events]))


def flash_path(device: torch.device) -> str:
    """How the routed path runs here: one call of torch's `varlen_attn` or of the ATen flash op, or SDPA per chunk."""
    varlen = varlen_attention(device.type)
    return varlen.__name__ if varlen is not None else "sdpa per chunk"


def varlen_attention(device_type: str) -> Callable | None:
    """One flash call for all chunks on a GPU: torch's `varlen_attn` where it takes a scale, a causal window and GQA
    as keywords (torch 2.12 and later), else the ATen flash op it wraps (2.11's `varlen_attn` takes no `enable_gqa`);
    None off the GPU or where neither exists."""
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


def routed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, case: Case, scale: float
                     ) -> torch.Tensor:
    """Chunks from scratch on flash attention over the step's own rows: one varlen call on a GPU, else causal SDPA
    per chunk."""
    varlen = varlen_attention(query.device.type)
    if varlen is not None:
        lens = torch.arange(0, (case.count + 1) * case.chunk, case.chunk, dtype=torch.int32, device=query.device)
        return varlen(query, key, value, lens, lens, case.chunk, case.chunk, scale=scale, window_size=(-1, 0),
                      enable_gqa=True)
    out = torch.empty_like(query)
    for start in range(0, case.count * case.chunk, case.chunk):
        one = [t[start : start + case.chunk].transpose(0, 1)[None] for t in (query, key, value)]
        out[start : start + case.chunk] = F.scaled_dot_product_attention(
            *one, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


def tile_map(query_lens: list[int], seq_lens: list[int], block_m: int, device: torch.device) -> torch.Tensor:
    """[tiles, 2] (sequence, tile index), the tiles that see the most KV first, as TritonOps plans them."""
    tiles = [(s, i) for s, n in enumerate(query_lens) for i in range(triton.cdiv(n, block_m))]
    tiles.sort(key=lambda t: -(seq_lens[t[0]] - query_lens[t[0]] + min((t[1] + 1) * block_m, query_lens[t[0]])))
    return torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 2)


def launch(config: Config, query, k_cache, v_cache, out, meta, tiles: torch.Tensor, scale: float) -> None:
    block_m, block_n, num_warps, num_stages = config
    prefill_attention(query, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_tables, tiles,
                      scale, block_m, block_n, num_warps, num_stages)


def compile_one(head_dim: int, heads: int, kv_heads: int, config: Config) -> str | None:
    """Compile and launch one candidate on a tiny batch of the same specialization: None, or why it failed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    query, k_cache, v_cache, meta = random_paged_batch([(16, 16)], heads, kv_heads, head_dim, BLOCK_SIZE,
                                                       torch.bfloat16, device)
    try:
        launch(config, query, k_cache, v_cache, torch.empty_like(query), meta,
               tile_map([16], [32], config[0], device), head_dim**-0.5)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a candidate that cannot run is a result, not a crash
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
    return None


def _compile_task(task: tuple[int, int, int, Config]) -> tuple[int, Config, str | None]:
    head_dim, heads, kv_heads, config = task
    return head_dim, config, compile_one(head_dim, heads, kv_heads, config)


def compile_all(plan: Plan) -> dict[tuple[int, Config], str | None]:
    """Every (head_dim, candidate): None when it runs, else why not. In worker processes, as compiles are most of
    this script's time on a GPU; the main process then finds the binaries in Triton's disk cache."""
    tasks = [(head_dim, heads, kv_heads, config) for heads, kv_heads, head_dim in plan.shapes.values()
             for config in plan.configs]
    workers = max(1, min(16, (os.cpu_count() or 2) - 1, len(tasks)))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = pool.map(_compile_task, tasks, chunksize=1)
    return {(head_dim, config): failure for head_dim, config, failure in done}


def sdpa_ms(case: Case, heads: int, head_dim: int, timer: Timer, device: torch.device) -> float:
    """The same work on contiguous tensors, KV heads expanded, as benchmarks/gpu/gpu.py times it."""
    q = torch.randn(case.count, heads, case.chunk, head_dim, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(case.count, heads, case.seq_len, head_dim, dtype=torch.bfloat16, device=device)
            for _ in range(2))
    mask = causal_lower_right(case.chunk, case.seq_len) if case.after_cached else None
    return timer(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not case.after_cached))


def bench_shape(name: str, shape: tuple[int, int, int], plan: Plan, compiled: dict, timer: Timer,
                device: torch.device, deadline: float) -> list[dict]:
    rows = []
    for case in plan.cases:
        rows += bench_case(name, shape, case, plan, compiled, timer, device, deadline)
    return rows


def bench_case(name: str, shape: tuple[int, int, int], case: Case, plan: Plan, compiled: dict, timer: Timer,
               device: torch.device, deadline: float) -> list[dict]:
    """SDPA, the routed path (from-scratch cases) and every candidate on one case."""
    heads, kv_heads, head_dim = shape
    scale = head_dim**-0.5
    query, k_cache, v_cache, meta = random_paged_batch(
        [(case.seq_len - case.chunk, case.chunk)] * case.count, heads, kv_heads, head_dim, BLOCK_SIZE,
        torch.bfloat16, device)
    out = torch.empty_like(query)
    base = {"shape": name, "head_dim": head_dim, "seq_len": case.seq_len, "chunk": case.chunk, "count": case.count,
            "after_cached": case.after_cached}
    sdpa = sdpa_ms(case, heads, head_dim, timer, device)
    tflop = 4 * heads * head_dim * case.pairs / 1e9  # TFLOP/s = tflop / ms
    rows = []
    if not case.after_cached:  # the step's own rows straight to flash attention
        key = k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping]
        value = v_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping]
        routed = timer(partial(routed_attention, query, key, value, case, scale))
        mode = flash_path(device)
        got = routed_attention(query, key, value, case, scale).float()
        kernel = TritonOps().attention(query, k_cache, v_cache, meta, scale).float()  # every chunk on the kernel
        rows.append({**base, "config": f"routed ({mode})", "ms": routed, "tflops": tflop / routed, "sdpa_ms": sdpa,
                     "speed_vs_sdpa": sdpa / routed, "max_err_vs_kernel": (got - kernel).abs().max().item(),
                     "close_to_kernel": torch.allclose(got, kernel, atol=ROUTED_TOLERANCE, rtol=ROUTED_TOLERANCE)})
    varlen = varlen_attention(device.type)
    if case.after_cached and case.count == 1 and varlen is not None:  # a candidate for a later routing, not run today
        try:
            gathered = gathered_flash(varlen, query, k_cache, v_cache, meta, case, scale, timer)
            rows.append({**base, **gathered, "tflops": tflop / gathered["ms"], "sdpa_ms": sdpa,
                         "speed_vs_sdpa": sdpa / gathered["ms"]})
        except Exception as error:  # noqa: BLE001 - recorded, the candidates still run
            rows.append({**base, "config": "gathered context", "failed": f"{type(error).__name__}: {error}"[:300]})
    tiles_by_m = {m: tile_map([case.chunk] * case.count, [case.seq_len] * case.count, m, device)
                  for m in {c[0] for c in plan.configs}}
    for config in plan.configs:
        row = {**base, "config": list(config)}
        failure = compiled.get((head_dim, config))
        if failure is not None:
            rows.append({**row, "failed": failure})
            continue
        if time.time() > deadline:
            rows.append({**row, "skipped": "time budget spent"})
            continue
        try:
            ms = timer(partial(launch, config, query, k_cache, v_cache, out, meta, tiles_by_m[config[0]], scale))
        except Exception as error:  # noqa: BLE001 - recorded, the next candidate still runs
            rows.append({**row, "failed": f"{type(error).__name__}: {str(error)[:200]}"})
            continue
        rows.append({**row, "ms": ms, "tflops": tflop / ms, "sdpa_ms": sdpa, "speed_vs_sdpa": sdpa / ms})
    return rows


def gathered_flash(varlen: Callable, query, k_cache, v_cache, meta, case: Case, scale: float, timer: Timer) -> dict:
    """A chunk after a cached context on flash attention, its whole context first gathered out of the pool (a copy
    of 2 x seq_len x Hkv x D values), against the prefill kernel's output: is the copy worth it?"""
    blocks = meta.block_tables[0, : triton.cdiv(case.seq_len, BLOCK_SIZE)]
    cu_q = torch.tensor([0, case.chunk], dtype=torch.int32, device=query.device)
    cu_k = torch.tensor([0, case.seq_len], dtype=torch.int32, device=query.device)

    def attend() -> torch.Tensor:
        key, value = (cache.index_select(0, blocks).flatten(0, 1)[: case.seq_len] for cache in (k_cache, v_cache))
        return varlen(query, key, value, cu_q, cu_k, case.chunk, case.seq_len, scale=scale, window_size=(-1, 0),
                      enable_gqa=True)

    got, kernel = attend().float(), TritonOps().attention(query, k_cache, v_cache, meta, scale).float()
    return {"config": f"gathered context + {varlen.__name__}", "ms": timer(attend),
            "max_err_vs_kernel": (got - kernel).abs().max().item(),
            "close_to_kernel": torch.allclose(got, kernel, atol=ROUTED_TOLERANCE, rtol=ROUTED_TOLERANCE)}


def best_tiles(rows: list[dict], plan: Plan) -> dict[tuple[int, bool], dict]:
    """Per (head_dim, after a cached context): the candidate with the best geometric-mean speed against SDPA
    over the cases it ran all of, and the current table's entry for comparison."""
    best = {}
    for head_dim, after_cached in sorted({(r["head_dim"], r["after_cached"]) for r in rows}):
        mine = [r for r in rows if r["head_dim"] == head_dim and r["after_cached"] == after_cached
                and isinstance(r["config"], list)]
        cases = {(r["seq_len"], r["chunk"], r["count"]) for r in mine}
        scores = {}
        for config in plan.configs:
            speeds = [r["speed_vs_sdpa"] for r in mine if tuple(r["config"]) == config and "speed_vs_sdpa" in r]
            if len(speeds) == len(cases):
                scores[config] = float(np.exp(np.mean(np.log(speeds))))
        if scores:
            winner = max(scores, key=scores.get)
            current = HOPPER_PREFILL_TILES.get((head_dim, after_cached))
            best[head_dim, after_cached] = {"config": winner, "geomean_vs_sdpa": scores[winner],
                                            "current": current, "current_geomean": scores.get(current)}
    return best


def print_rows(rows: list[dict]) -> None:
    print(f"{'shape':>12} {'seq':>6} {'chunk':>6} {'n':>2} {'config':>22} {'ms':>9} {'TFLOP/s':>8} {'vs SDPA':>8}")
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:>12} {r['seq_len']:>6} {r['chunk']:>6} {r['count']:>2} {r['config']!s:>22} "
                  f"{r['ms']:>9.3f} {r['tflops']:>8.1f} {r['speed_vs_sdpa']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_prefill_tiles.json"))
    parser.add_argument("--smoke", action="store_true", help="a tiny shape and two candidates on the CPU interpreter")
    args = parser.parse_args()
    if args.smoke:
        plan, device = SMOKE, torch.device("cpu")
    elif torch.cuda.is_available():
        plan, device = FULL, torch.device("cuda")
    else:
        sys.exit("no GPU: run with --smoke to test the script on the CPU")
    start = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    mode = flash_path(device)
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}; from-scratch chunks: {mode}")
    results: dict = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "routed": mode,
                     "rows": [], "errors": {}}
    compiled = compile_all(plan)
    results["compile_failures"] = {f"{d} {list(c)}": why for (d, c), why in compiled.items() if why}
    results["compile_s"] = round(time.time() - start, 1)
    print(f"compiled {len(compiled)} candidates in {results['compile_s']} s, "
          f"{len(results['compile_failures'])} cannot run")
    timer = Timer(device, plan.reps)
    deadline = start + plan.budget_s
    for shape_name, shape in plan.shapes.items():
        try:
            results["rows"] += bench_shape(shape_name, shape, plan, compiled, timer, device, deadline)
        except Exception:  # noqa: BLE001 - the other shape still runs
            results["errors"][shape_name] = traceback.format_exc()
            print(results["errors"][shape_name])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    best = best_tiles(results["rows"], plan)
    results["best"] = {f"{d} {'after cached' if c else 'from scratch'}": v for (d, c), v in best.items()}
    routed = [r for r in results["rows"] if str(r["config"]).startswith("routed")]
    print("\nthe routed path of from-scratch chunks, and the best candidate per case:")
    print_rows(routed)
    results["routed_max_err"] = max((r["max_err_vs_kernel"] for r in routed), default=float("nan"))
    print(f"routed path against the prefill kernel: max |err| {results['routed_max_err']:.2e}")
    if not routed or not all(r["close_to_kernel"] for r in routed):
        results["errors"]["routed"] = f"routed path beyond {ROUTED_TOLERANCE} of the kernel (or not run)"
    for key in best:
        rows = [r for r in results["rows"] if (r["head_dim"], r["after_cached"]) == key
                and isinstance(r["config"], list) and tuple(r["config"]) == best[key]["config"]]
        print_rows(rows)
    print("\npaste into kernels/triton/ops.py (comments: geometric mean of the speed against SDPA; today's entry's):")
    print("HOPPER_PREFILL_TILES: dict[tuple[int, bool], tuple[int, int, int, int]] = {")
    for (head_dim, after_cached), entry in best.items():
        current = entry["current_geomean"]
        print(f"    ({head_dim}, {after_cached}): {entry['config']},  # {entry['geomean_vs_sdpa']:.2f}x; today "
              f"{entry['current']}: {'not run' if current is None else f'{current:.2f}x'}")
    print("}")
    results["seconds"] = round(time.time() - start, 1)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}; total {results['seconds']} s")
    if results["errors"]:
        sys.exit(f"failed: {sorted(results['errors'])}")


if __name__ == "__main__":
    main()
