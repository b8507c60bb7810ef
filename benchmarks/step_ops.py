"""Where a decode step's time goes, op by op, inside a real decode-heavy job (SmolLM2-135M on the CPU).

    python benchmarks/step_ops.py                       # this checkout
    python benchmarks/step_ops.py --baseline REV        # and, in the same run, the code at git REV

Runs `decode512`'s 80 rows (benchmarks/workloads.py) for `--tokens` output tokens each, in `--dtype` (float32 by
default), 2 threads, with a timer around every call of each op kind (linear layers, the LM head's pick, attention
and the decode kernel inside it, RMSNorm, RoPE, the KV store, the step's attention plan) and reports milliseconds
per decode-only step.
An op kind the revision does not have as a separate call is left out. The timers cost about a microsecond per
call (about 400 calls a step). Times of ops that contain others (attention contains the kernel; the LM head its
linear chunks) include them.

The baseline runs the same script against another revision (a temporary git worktree), as a child process.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


def instrument() -> tuple[dict, dict]:
    """Timers around every op kind and the model's forward; per-forward times are kept for decode-only steps."""
    step: dict[str, float] = collections.defaultdict(float)
    totals: dict[str, float] = collections.defaultdict(float)
    counts = {"decode_steps": 0}

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

    forward = DecoderModel.forward

    def counted_forward(self, input_ids, positions, kv_caches, meta, *args, **kwargs):
        step.clear()
        start = time.perf_counter()
        result = forward(self, input_ids, positions, kv_caches, meta, *args, **kwargs)
        if meta.is_decode_only:
            totals["forward"] += time.perf_counter() - start
            for label, seconds in step.items():
                totals[label] += seconds
            counts["decode_steps"] += 1
        return result

    DecoderModel.forward = counted_forward
    return totals, counts


def measure(args) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import workloads

    totals, counts = instrument()
    from batchprefill.cli.run import main as run_main

    with tempfile.TemporaryDirectory() as work:
        path = workloads.decode_heavy(args.tokens).write(Path(work))
        sys.argv = ["batchprefill-run", f"data.input={path}", f"output.dir={work}/out",
                    f"sampling.max_tokens={args.tokens}", "sampling.ignore_eos=true", "data.chat_template=false",
                    f"model.dtype={args.dtype}", "engine.kv_cache_tokens=65536", f"engine.num_threads={args.threads}",
                    "engine.max_batched_tokens=2048", "engine.max_num_seqs=256", "engine.block_size=16",
                    "output.progress=false", "output.plot=false", f"hydra.run.dir={work}/hydra",
                    *(["engine.batch_invariant=true"] * args.batch_invariant)]  # a revision before it lacks the key
        try:
            run_main()
        except SystemExit as end:
            if end.code:
                raise
    steps = counts["decode_steps"]
    return {"decode_steps": steps, **{label: round(1e3 * seconds / steps, 2) for label, seconds in totals.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-invariant", action="store_true", help="with engine.batch_invariant=true")
    parser.add_argument("--baseline", help="a git revision to measure too, in the same run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    rows = {"this": _child(REPO, args)}
    if args.baseline:
        with tempfile.TemporaryDirectory() as folder:
            tree = Path(folder) / "tree"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline],
                           check=True, capture_output=True)
            try:
                rows["baseline"] = _child(tree, args)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
    labels = ["forward"] + sorted({k for row in rows.values() for k in row} - {"forward", "decode_steps"})
    print("| code | decode steps | " + " | ".join(f"{label} ms" for label in labels) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in labels) + " |")
    for name, row in rows.items():
        print(f"| {name} | {row['decode_steps']} | " + " | ".join(str(row.get(label, "")) for label in labels) + " |")
    if args.out:
        args.out.write_text(json.dumps({"tokens": args.tokens, "threads": args.threads, "dtype": args.dtype,
                                        "batch_invariant": args.batch_invariant, **rows}, indent=1))


def _child(tree: Path, args) -> dict:
    """This script, run from `tree`'s code (the script itself always from this checkout)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--tokens", str(args.tokens),
               "--threads", str(args.threads), "--dtype", args.dtype, *(["--batch-invariant"] * args.batch_invariant)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
