"""Where a decode step's time goes, op by op, inside a real decode-heavy job (SmolLM2-135M on the CPU).

    python benchmarks/cpu/step_ops.py                       # this checkout
    python benchmarks/cpu/step_ops.py --baseline REV        # and, in the same run, the code at git REV
    python benchmarks/cpu/step_ops.py --job reward          # a prefill-only job instead: seconds over all its steps
    python benchmarks/cpu/step_ops.py --kv-cache-dtype fp8  # with engine.kv_cache_dtype=fp8 (default auto)
    python benchmarks/cpu/step_ops.py --block-size 64       # with engine.block_size=64 (default 16)

Runs `decode512`'s 80 rows (benchmarks/workloads.py) for `--tokens` output tokens each, in `--dtype` (float32 by
default), 2 threads, with a timer around every call of each op kind (linear layers, the LM head's pick, attention
and the decode kernel inside it, RMSNorm, RoPE, the KV store, the step's attention plan) and reports milliseconds
per decode-only step.
An op kind the revision does not have as a separate call is left out. The timers cost about a microsecond per
call (about 400 calls a step). Times of ops that contain others (attention contains the kernel; the LM head its
linear chunks) include them.

With `--job reward` or `--job embed`, the job is benchmarks/peers/pooling.py's best-of-8 reward scoring or corpus
embedding (its models, built under /tmp/bp-pooling, and its rows), on `--threads` threads, and the figures are
seconds summed over every step of the job, the model's pass up to its final norm standing for the forward.

The baseline runs the same script against another revision (a temporary git worktree), as a child process.
Each side runs `--rounds` times (default 2), in turn as this, baseline, baseline, this, ..., and each figure is the
side's best round for that op, as the walk benchmarks keep their best of 7. One round each, this first, gave this
checkout 0.85-0.96x of the baseline's attention time with the same code on both sides (AMD EPYC Zen 4, session 49).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# (module, class, method, label): wrapped where the revision has them
OPS = [
    ("batchprefill.kernels.linear", "Linear", "__call__", "linear"),
    ("batchprefill.model.lm_head", "LMHead", "greedy_tokens", "lm_head"),
    ("batchprefill.kernels.torch.ops", "TorchOps", "attention", "attention"),
    ("batchprefill.kernels.native.paged_decode", "PagedDecode", "attend", "decode kernel"),  # before one call per layer
    ("batchprefill.kernels.native.paged_decode", "PagedDecode", "run", "decode kernel"),
    ("batchprefill.kernels.torch.ops", "TorchOps", "rms_norm", "rms_norm"),  # torch methods before session 5
    ("batchprefill.kernels.torch.ops", "TorchOps", "rope", "rope"),
    ("batchprefill.kernels.torch.ops", "TorchOps", "store_kv", "store_kv"),
    ("batchprefill.kernels.native.elementwise", "NativeElementwise", "rms_norm", "rms_norm"),
    ("batchprefill.kernels.native.elementwise", "NativeElementwise", "rope", "rope"),
    ("batchprefill.kernels.native.elementwise", "NativeElementwise", "store_kv", "store_kv"),
    ("batchprefill.kernels.torch.ops", "TorchOps", "plan", "plan"),
]


def instrument(outer: str = "forward", decode_only: bool = True) -> tuple[dict, dict]:
    """Timers around every op kind and the model's `outer` pass; per-pass times are kept for decode-only steps, or
    for every step."""
    step: dict[str, float] = collections.defaultdict(float)
    totals: dict[str, float] = collections.defaultdict(float)
    counts = {"passes": 0}

    def timed(function, label):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                step[label] += time.perf_counter() - start
        return wrapper

    for module_name, class_name, method, label in OPS:
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if method in vars(owner):
            setattr(owner, method, timed(vars(owner)[method], label))
    from batchprefill.model.decoder import DecoderModel

    forward = getattr(DecoderModel, outer)

    def counted_forward(self, input_ids, positions, kv_caches, meta, *args, **kwargs):
        step.clear()
        start = time.perf_counter()
        result = forward(self, input_ids, positions, kv_caches, meta, *args, **kwargs)
        if meta.is_decode_only or not decode_only:
            totals["forward"] += time.perf_counter() - start
            for label, seconds in step.items():
                totals[label] += seconds
            counts["passes"] += 1
        return result

    setattr(DecoderModel, outer, counted_forward)
    return totals, counts


def measure(args) -> dict:
    sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "peers")]  # workloads, pooling
    import workloads

    decode = args.job == "decode"
    totals, counts = instrument("forward" if decode else "final_hidden", decode_only=decode)
    import batchprefill.cli.run as cli_run

    # The command in this process: `main` ends the process when it is done (cli.app.console_script); a revision
    # before that has `main` alone, which ends in SystemExit.
    run_command = getattr(cli_run, "command", cli_run.main)

    with tempfile.TemporaryDirectory() as work:
        if decode:
            path = workloads.decode_heavy(args.tokens).write(Path(work))
            job = [f"sampling.max_tokens={args.tokens}", "sampling.ignore_eos=true", "data.chat_template=false",
                   f"engine.block_size={args.block_size}"]
        else:
            import pooling

            folder = pooling.build_models(Path("/tmp/bp-pooling"))[args.job]
            rows = pooling.reward_rows(96, 8) if args.job == "reward" else pooling.embed_rows()
            path = pooling.write(rows, Path(work) / f"{args.job}.parquet")
            job = [f"task={'classify' if args.job == 'reward' else 'embed'}", "model=hf", f"model.path={folder}"]
        sys.argv = ["batchprefill-run", f"data.input={path}", f"output.dir={work}/out", *job,
                    f"model.dtype={args.dtype}", "engine.kv_cache_tokens=65536", f"engine.num_threads={args.threads}",
                    "engine.max_batched_tokens=2048", "engine.max_num_seqs=256",
                    "output.progress=false", "output.plot=false", f"hydra.run.dir={work}/hydra",
                    *(["engine.batch_invariant=true"] * args.batch_invariant),  # a revision before it lacks the key
                    *([f"engine.kv_cache_dtype={args.kv_cache_dtype}"] * (args.kv_cache_dtype != "auto"))]
        try:
            run_command()
        except SystemExit as end:
            if end.code:
                raise
    if not decode:
        return {"steps": counts["passes"], **{label: round(seconds, 2) for label, seconds in totals.items()}}
    steps = counts["passes"]
    return {"decode_steps": steps, **{label: round(1e3 * seconds / steps, 2) for label, seconds in totals.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="decode", choices=["decode", "reward", "embed"])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-invariant", action="store_true", help="with engine.batch_invariant=true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="engine.kv_cache_dtype (auto: the model's dtype)")
    parser.add_argument("--block-size", type=int, default=16, help="engine.block_size of the decode job")
    parser.add_argument("--baseline", help="a git revision to measure too, in the same run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, in turn (best kept)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    with contextlib.ExitStack() as stack:
        trees = {"this": REPO}
        if args.baseline:
            from revisions import checkout

            trees["baseline"] = stack.enter_context(checkout(args.baseline))
        rounds: dict[str, list[dict]] = {name: [] for name in trees}
        for index in range(args.rounds):
            order = list(trees) if index % 2 == 0 else list(trees)[::-1]  # this, baseline, baseline, this, ...
            for name in order:
                rounds[name].append(_child(trees[name], args))
    rows = {name: best_of(runs) for name, runs in rounds.items()}
    steps = "decode_steps" if args.job == "decode" else "steps"
    labels = ["forward"] + sorted({k for row in rows.values() for k in row} - {"forward", steps})
    unit = "ms" if args.job == "decode" else "s"
    print(f"| code | {steps.replace('_', ' ')} | " + " | ".join(f"{label} {unit}" for label in labels) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in labels) + " |")
    for name, row in rows.items():
        print(f"| {name} | {row[steps]} | " + " | ".join(str(row.get(label, "")) for label in labels) + " |")
    if args.out:
        settings = {"job": args.job, "tokens": args.tokens, "threads": args.threads, "dtype": args.dtype,
                    "batch_invariant": args.batch_invariant, "kv_cache_dtype": args.kv_cache_dtype,
                    "block_size": args.block_size, "rounds_each": args.rounds}
        args.out.write_text(json.dumps({**settings, **rows, "rounds": rounds}, indent=1))


def best_of(runs: list[dict]) -> dict:
    """Each op's least time over a side's rounds (the step counts are the same in every round)."""
    return {label: min(run[label] for run in runs) for label in runs[0]}


def _child(tree: Path, args) -> dict:
    """This script, run from `tree`'s code (the script itself always from this checkout)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--job", args.job, "--tokens",
               str(args.tokens), "--threads", str(args.threads), "--dtype", args.dtype,
               *(["--batch-invariant"] * args.batch_invariant), "--kv-cache-dtype", args.kv_cache_dtype,
               "--block-size", str(args.block_size)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
