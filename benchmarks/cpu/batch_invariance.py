"""What `engine.batch_invariant` costs (issue 25): the engine loop with and without it, side by side in one run.

    python benchmarks/cpu/batch_invariance.py --out benchmarks/results/batch_invariance.json  # decode128, shared
    python benchmarks/cpu/batch_invariance.py --rows 16 --dtypes bfloat16 --pairs 1   # a smoke test
    python benchmarks/cpu/batch_invariance.py --reproducibility --out benchmarks/results/batch_invariance_rows.json

For each precision and workload, `--pairs` alternating pairs of jobs (off, on, then on, off, ...), one at a time,
so a drift of the machine's speed lands on both sides. The figure is the engine loop (the steps' summed
durations, as compare.py reports against vLLM's generate()), and the ratio on/off. On a shared virtual machine
single steps stall for seconds now and then (seen: 13 s for a 70 ms step, and whole runs 10x slower); a job's
schedule does not depend on timing, so its runs take the same steps, and the robust figure sums each step at its
fastest over the runs of a setting (`loop_fastest_steps`); the plain medians are kept beside it. The greedy
agreement of the two settings' outputs is reported beside it: the same model, the same tokens on most rows, the
bits of a few rows moved (which is what the setting stops).

`--reproducibility` measures what the setting is for, as issue 25 did: 80 rows over shared prefixes, 48 greedy
tokens each, run as configured, then with 5 sequences and 96 tokens a step, then in input order; it counts the
rows whose tokens and logprobs equal the first run's, with the setting off and on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))  # compare

import compare  # noqa: E402
import workloads as wl  # noqa: E402


def step_durations(out: Path) -> list[float]:
    """A job's step durations in seconds, in step order (stats/steps.parquet)."""
    import polars as pl

    return (pl.read_parquet(out / "stats" / "steps.parquet").sort("step")["duration_ms"] / 1e3).to_list()


def fastest_steps(runs: list[list[float]]) -> float:
    """The loop with each step at its fastest over runs that took the same steps."""
    if len({len(steps) for steps in runs}) != 1:
        raise SystemExit("the runs of one setting took different numbers of steps: the schedule is not repeatable")
    return sum(min(times) for times in zip(*runs))


VARIANTS = {"max_num_seqs=5, max_batched_tokens=96": {"engine.max_num_seqs": 5, "engine.max_batched_tokens": 96},
            "data.order=input": {"data.order": "input"}}


def reproducibility(args, meta: dict) -> None:
    """Identical rows against the default schedule, per precision and setting."""
    import polars as pl

    workload = wl.decode_heavy(48)
    wl.finalize(workload, wl.token_ids(workload.prompts, compare.wl_folder()))
    path = workload.write(args.work)
    cases = []
    for dtype in args.dtypes.split(","):
        args.dtype = dtype
        for setting in ("false", "true"):
            outputs = []
            for name, overrides in {"as configured": {}, **VARIANTS}.items():
                label = f"rows-{dtype}-{setting}-{len(outputs)}"
                print(f"  {label}: {name} ...", file=sys.stderr, flush=True)
                compare.run_batchprefill(path, args.work, label, 48, compare.BIG_POOL, args,
                                         **{"engine.batch_invariant": setting, "sampling.logprobs": 1,
                                            "engine.max_num_seqs": 256, **overrides})
                table = pl.read_parquet(args.work / f"bp-{label}" / "results").sort("id")
                outputs.append(table.select("id", "output_token_ids", "output_logprobs").rows())
            for name, rows in zip(VARIANTS, outputs[1:]):
                same = sum(a == b for a, b in zip(outputs[0], rows))
                tokens = sum(a[1] == b[1] for a, b in zip(outputs[0], rows))
                cases.append({"dtype": dtype, "batch_invariant": setting == "true", "variant": name,
                              "identical_rows": same, "identical_tokens": tokens, "rows": len(rows)})
                print(f"{dtype} batch_invariant={setting} {name}: {same}/{len(rows)} rows identical (tokens "
                      f"{tokens}/{len(rows)})", flush=True)
                if args.out:
                    args.out.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-invariance"), help="scratch folder")
    parser.add_argument("--workloads", default="decode128,shared")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--pairs", type=int, default=2, help="alternating (off, on) pairs per case")
    parser.add_argument("--rows", type=int, help="keep only the first ROWS prompts of each workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--reproducibility", action="store_true", help="count identical rows instead of timing")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.model = None
    meta = {"command": " ".join(sys.argv), "cpu": wl.cpu_model(), "threads": args.threads,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.reproducibility:
        reproducibility(args, meta)
        return
    folder = compare.wl_folder()
    cases = []
    for workload in wl.all_workloads():
        if workload.name not in args.workloads.split(","):
            continue
        workload.prompts = workload.prompts[: args.rows]
        wl.finalize(workload, wl.token_ids(workload.prompts, folder))
        path = workload.write(args.work)
        for dtype in args.dtypes.split(","):
            args.dtype = dtype
            runs: dict[str, list[dict]] = {"false": [], "true": []}
            for pair in range(args.pairs):
                for setting in ("false", "true") if pair % 2 == 0 else ("true", "false"):
                    label = f"{workload.name}-{dtype}-{setting}-{pair}"
                    print(f"  {label} ...", file=sys.stderr, flush=True)
                    row = compare.run_batchprefill(path, args.work, label, workload.max_tokens,
                                                   workload.kv_pool_tokens or compare.BIG_POOL, args,
                                                   **{"engine.batch_invariant": setting})
                    print(f"    loop {row['generate_seconds']:.1f} s", file=sys.stderr, flush=True)
                    row["steps"] = step_durations(args.work / f"bp-{label}")
                    runs[setting].append(row)
            fastest = {s: fastest_steps([r["steps"] for r in runs[s]]) for s in runs}
            loops = {s: [r["generate_seconds"] for r in runs[s]] for s in runs}
            agreement = compare.agreement(runs["false"][0]["outputs"], runs["true"][0]["outputs"])
            cases.append({"workload": workload.name, "dtype": dtype, "loop_off": loops["false"],
                          "loop_on": loops["true"], "loop_fastest_steps_off": fastest["false"],
                          "loop_fastest_steps_on": fastest["true"], "ratio": fastest["true"] / fastest["false"],
                          "median_ratio": statistics.median(loops["true"]) / statistics.median(loops["false"]),
                          "greedy_agreement": agreement, "prompts": len(workload.prompts),
                          "max_tokens": workload.max_tokens})
            print(f"{workload.name} {dtype}: loop (fastest steps) off {fastest['false']:.2f} s, on "
                  f"{fastest['true']:.2f} s, {cases[-1]['ratio']:.2f}x (medians {cases[-1]['median_ratio']:.2f}x), "
                  f"greedy agreement {agreement:.0%}", flush=True)
            if args.out:
                args.out.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
