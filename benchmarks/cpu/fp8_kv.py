"""FP8 KV (engine.kv_cache_dtype) against the model dtype's own KV on the shipped model: how often task=score picks
the same best choice, and how long greedy answers stay the same.

    python benchmarks/cpu/fp8_kv.py                          # fp8 (e4m3) against auto, model.dtype=auto
    python benchmarks/cpu/fp8_kv.py --kv-cache-dtype fp8_e5m2 --prompts 16 --tokens 64
    python benchmarks/cpu/fp8_kv.py --walks --threads 1      # the C++ decode walks' time over each pool dtype
    python benchmarks/cpu/fp8_kv.py --walks --baseline REV   # ... and the same walks at REV's kernel, in turn
    python benchmarks/cpu/fp8_kv.py --walks --block 64       # ... over a pool of 64-token blocks
    python benchmarks/cpu/fp8_kv.py --stores --baseline REV  # a decode step's KV stores, bfloat16 and e4m3 pools

Score rows: the shipped sample's 48 prompts (data_samples/prompts.parquet), each scored twice, against the four
documents' subjects (" Paris", " honey bees", " Mount Etna", " the James Webb Space Telescope") and against four
one-sentence answers, 96 rows of 4 choices. Greedy rows: the first `--prompts` sample prompts in the chat template,
`--tokens` tokens each, EOS ignored, so every row has as many tokens to compare.

`--walks`: a decode step's attention for 30 layers (30 distinct pools, read from memory as a real step reads them)
in the C++ kernel, bfloat16 queries over bfloat16, e4m3 and e5m2 pools of the same values, the three timed in turn
and the best of 7 rounds kept, so a busy machine slows them alike (benchmarks/cpu/cpu_ops.py's decode batches,
SmolLM2's shapes). Milliseconds (the process's CPU time with one thread, wall time with more), and each FP8
pool's time over bfloat16's. `--baseline REV` builds REV's
paged_decode.cpp here with the same flags (benchmarks/cpu/walk_builds.py) and times its walks in the same turns.
`--block N`: the pools' block size (engine.block_size; 16 by default). Each case's prefix rounds up to whole blocks,
so bigger blocks read more tokens (at 64 the 128- and 512-token lone decodes read 176 and 528; at 128 the 448 shared
tokens are 512).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

import batchprefill

REPO = Path(__file__).resolve().parents[2]
SUBJECTS = [" Paris", " honey bees", " Mount Etna", " the James Webb Space Telescope"]
ANSWERS = [" It is about a city and its famous buildings.", " It is about insects that make honey.",
           " It is about a volcano in Italy.", " It is about a telescope in space."]


def score_rows() -> pl.DataFrame:
    prompts = pl.read_parquet(REPO / "data_samples" / "prompts.parquet").filter(pl.col("topic") != "bad-input")
    return pl.concat([prompts.select("id", "prompt").with_columns(pl.col("id") + suffix, choices=pl.lit(choices))
                      for suffix, choices in (("-subject", SUBJECTS), ("-answer", ANSWERS))])


WALK_CASES = [(9, 9, 448, 48, "9 groups of 9 decodes over 448 shared tokens, 48 own"),
              (81, 1, 16, 112, "81 lone decodes of 128 tokens"), (80, 1, 496, 16, "80 lone decodes of 512 tokens")]


def walks(threads: int, baseline: str | None, block: int) -> None:
    import tempfile

    import torch

    sys.path.insert(0, str(REPO / "benchmarks" / "cpu"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cpu_ops import HEADS, decode_batch
    from walk_builds import built_ops, revision_sources
    from workloads import cpu_model

    from batchprefill.kernels.fp8_kv import to_cache
    from batchprefill.kernels.native import build as native
    from batchprefill.kernels.torch.ops import TorchOps

    torch.set_num_threads(threads)
    # one thread: the process's CPU time, which other processes' turns on a shared machine do not inflate
    clock = time.process_time if threads == 1 else time.perf_counter
    folder = tempfile.TemporaryDirectory()
    builds = {"this checkout": TorchOps()}
    if baseline:  # the baseline revision's kernel built here with the same flags, timed in turn with this one's
        source = revision_sources(baseline, Path(folder.name), REPO) / "paged_decode.cpp"
        builds = {baseline: built_ops(source, Path(folder.name) / "baseline.so", []),
                  "this checkout": built_ops(native.SOURCES / "paged_decode.cpp", Path(folder.name) / "this.so", [])}
    dtypes = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    timing = "CPU time" if threads == 1 else "wall time"
    print(f"CPU: {cpu_model()}; {threads} thread(s); blocks of {block} tokens; ms a step of 30 layers ({timing}), "
          "best of 7")
    print("| case | build | bfloat16 ms | e4m3 ms | e5m2 ms | e4m3 / bfloat16 | e5m2 / bfloat16 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for groups, members, prefix, own, name in WALK_CASES:
        query, keys, values, meta = decode_batch(groups=groups, members=members, prefix=prefix, own=own, block=block)
        query = query.bfloat16()
        pools = {dtype: [(to_cache(keys + 0.01 * i, dtype), to_cache(values - 0.01 * i, dtype)) for i in range(30)]
                 for dtype in dtypes}
        plans = {(label, dtype): ops.plan(meta, layers[0][0], HEADS, query.dtype)
                 for label, ops in builds.items() for dtype, layers in pools.items()}
        best = dict.fromkeys(plans, float("inf"))
        for _ in range(7):
            for label, ops in builds.items():
                for dtype, layers in pools.items():
                    start = clock()
                    for k_cache, v_cache in layers:
                        ops.attention(query, k_cache, v_cache, plans[label, dtype], 0.125)
                    best[label, dtype] = min(best[label, dtype], clock() - start)
        for label in builds:
            ms = [1e3 * best[label, dtype] for dtype in dtypes]
            print(f"| {name} | {label} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {ms[1] / ms[0]:.2f} "
                  f"| {ms[2] / ms[0]:.2f} |")
    folder.cleanup()


def stores(baseline: str | None) -> None:
    """A decode step's KV stores (80 tokens x 3 KV heads x 64 per layer, bfloat16 keys and values, 30 layers) into a
    bfloat16 pool and an e4m3 one, by this checkout's elementwise.cpp and `baseline`'s built alike, in turn."""
    import ctypes
    import tempfile

    import torch

    sys.path.insert(0, str(REPO / "benchmarks" / "cpu"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from walk_builds import revision_sources
    from workloads import cpu_model

    from batchprefill.kernels.native import build as native
    from batchprefill.kernels.native.elementwise import NativeElementwise

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    sources = {"this checkout": native.SOURCES / "elementwise.cpp"}
    if baseline:
        sources[baseline] = revision_sources(baseline, folder, REPO) / "elementwise.cpp"
    builds = {}
    for label, source in sources.items():
        library = folder / f"{len(builds)}.so"
        subprocess.run(["c++", *native.FLAGS, "-o", str(library), str(source)], check=True)
        builds[label] = NativeElementwise(ctypes.CDLL(str(library)))
    generator = torch.Generator().manual_seed(0)
    keys = [torch.randn(80, 3, 64, generator=generator).bfloat16() for _ in range(30)]
    slots = torch.randperm(4096, generator=generator)[:80]
    pools = {dtype: [torch.zeros(256, 16, 3, 64, dtype=dtype) for _ in range(2)]
             for dtype in (torch.bfloat16, torch.float8_e4m3fn)}
    best = {(label, dtype): float("inf") for label in builds for dtype in pools}
    for _ in range(20):
        for label, ops in builds.items():
            for dtype, (k_cache, v_cache) in pools.items():
                start = time.process_time()
                for key in keys:
                    ops.store_kv(key, key, k_cache, v_cache, slots)
                best[label, dtype] = min(best[label, dtype], time.process_time() - start)
    print(f"CPU: {cpu_model()}; 1 thread; ms of CPU time for 30 layers' stores of 80 tokens, best of 20")
    print("| build | into bfloat16 | into e4m3 |")
    print("| --- | ---: | ---: |")
    for label in builds:
        print(f"| {label} | " + " | ".join(f"{1e3 * best[label, dtype]:.2f}" for dtype in pools) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--dtype", default="auto", help="model.dtype")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--walks", action="store_true", help="time the C++ decode walks instead")
    parser.add_argument("--threads", type=int, default=1, help="with --walks")
    parser.add_argument("--block", type=int, default=16, help="with --walks: the pools' block size")
    parser.add_argument("--stores", action="store_true", help="time the C++ KV stores instead")
    parser.add_argument("--baseline", help="with --walks or --stores: also time this git revision's kernel, built "
                        "here, in turn")
    args = parser.parse_args()
    if args.stores:
        stores(args.baseline)
        return
    if args.walks:
        walks(args.threads, args.baseline, args.block)
        return
    scored = score_rows()
    greedy = pl.read_parquet(REPO / "data_samples" / "prompts.parquet").filter(
        pl.col("topic") != "bad-input").head(args.prompts).select("id", "prompt")
    results = {}
    for kv in ("auto", args.kv_cache_dtype):
        runner = batchprefill.Runner(progress=False, **{"model.dtype": args.dtype, "engine.kv_cache_dtype": kv,
                                                        "output.plot": False})
        results[kv] = (
            runner.run(scored, task="score").table.sort("id"),
            runner.run(greedy, **{"data.chat_template": True, "sampling.max_tokens": args.tokens,
                                  "sampling.ignore_eos": True}).table.sort("id"))
    (base_score, base_text), (fp8_score, fp8_text) = results["auto"], results[args.kv_cache_dtype]
    same_best = int((base_score["best_choice"] == fp8_score["best_choice"]).sum())
    logprob_gap = max(abs(a - b) for x, y in zip(base_score["choice_logprobs"], fp8_score["choice_logprobs"])
                      for a, b in zip(x, y))
    common = []
    for a, b in zip(base_text["output_token_ids"], fp8_text["output_token_ids"]):
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        common.append(first_difference)
    report = {
        "model_dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "score_rows": len(base_score), "score_same_best": same_best,
        "score_agreement": round(same_best / len(base_score), 4),
        "score_largest_logprob_difference": round(logprob_gap, 4),
        "greedy_rows": len(common), "greedy_tokens": args.tokens,
        "greedy_rows_identical": sum(n == args.tokens for n in common),
        "greedy_mean_tokens_before_first_difference": round(sum(common) / len(common), 1),
        "greedy_tokens_before_first_difference": common,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
