"""batchprefill against its own code at another git revision, on the benchmark workloads, run by run in turn.

    python benchmarks/cpu/revisions.py --baseline REV --only shared,corpus --dtype bfloat16 --runs 2

Each workload (benchmarks/workloads.py) runs at this checkout and at REV (a temporary git worktree) in turn, A B A
B, with compare.py's settings and its wait for a quiet machine, so a drift of the machine's speed hits both; the
figure is the engine loop (the job's steps summed), in seconds, each run's. No vLLM runs: this says whether a change
moved our own time, where compare.py says where we stand against the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))  # compare

import compare  # noqa: E402
import workloads as wl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """The code at `rev` in a temporary detached worktree of this repository, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bp-baseline-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def runs_from(tree: Path) -> None:
    """Refuse to go on unless a job started as `run_batchprefill` starts it imports `tree`'s code. Before this check
    the jobs ran in the caller's working directory, which `python -m` puts ahead of PYTHONPATH: started from the
    repository's root, the baseline ran this checkout's code, and every figure compared the checkout with itself."""
    found = subprocess.run([sys.executable, "-c", "import batchprefill; print(batchprefill.__file__)"], cwd=tree,
                           env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    if not Path(found.stdout.strip()).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"a job for {tree} would import {found.stdout.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a git revision")
    parser.add_argument("--only", default="shared,corpus", help="workload names, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="engine.kv_cache_dtype for both revisions")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bp-revisions"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.model = None  # the shipped model, as compare.run_batchprefill reads it
    args.work = args.work.resolve()  # the jobs run in the trees
    args.work.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",")
    report: dict = {"command": " ".join(sys.argv), "baseline": args.baseline, "dtype": args.dtype,
                    "kv_cache_dtype": args.kv_cache_dtype, "threads": args.threads, "cpu": wl.cpu_model()}
    with checkout(args.baseline) as baseline:
        trees = {"this": REPO, "baseline": baseline}
        for tree in trees.values():
            runs_from(tree)
        for workload in wl.all_workloads():
            if workload.name not in names:
                continue
            wl.finalize(workload, wl.token_ids(workload.prompts, compare.wl_folder()))
            path = workload.write(args.work)
            pool = workload.kv_pool_tokens or compare.BIG_POOL
            seconds: dict[str, list[float]] = {label: [] for label in trees}
            for _ in range(args.runs):
                for label, tree in trees.items():
                    result = compare.run_batchprefill(path, args.work, label, workload.max_tokens, pool, args,
                                                      env={"PYTHONPATH": str(tree)}, cwd=tree)
                    seconds[label].append(round(result["generate_seconds"], 2))
            report[workload.name] = seconds
            print(f"{workload.name}: engine loop s, this {seconds['this']}, {args.baseline} {seconds['baseline']}",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
