"""The decode kernel's walks as two builds run them: this checkout's paged_decode.cpp against a baseline revision's,
both compiled here with the same flags, timed in turns in one process.

    python benchmarks/cpu/walk_builds.py --baseline REV --switch-off=-mno-avx512f   # as a CPU without AVX-512 runs it
    python benchmarks/cpu/walk_builds.py --baseline REV --dtype bfloat16            # a bfloat16 model's walks, no tiles

`-march=native -mno-avx512f` on an AVX-512 machine compiles what `-march=native` compiles on an AVX2 one (AMD Zen 2
and 3), so one machine measures both builds on the same silicon (an AVX2-only CPU's own clocks and caches may move
the figures, not which build is faster). `--dtype bfloat16` walks a bfloat16 pool with a bfloat16 model's queries
(bfloat16 values, handed to the vector walks as float32; a CPU with AMX takes the tile walks instead, which
benchmarks/cpu/decode_walks.py measures). SmolLM2-135M's shapes, one thread, 30 layers a step, the cases of
benchmarks/cpu/decode_walks.py with the pool in cache and from memory; milliseconds, the best of `--rounds` rounds of
its best-of-5, the two builds alternating (a shared machine's speed drifts by 10-30% within minutes).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: workloads

from cpu_ops import HEADS, decode_batch  # noqa: E402
from decode_walks import CASES, best_ms  # noqa: E402
from workloads import cpu_model  # noqa: E402

from batchprefill.kernels.native import build as native  # noqa: E402
from batchprefill.kernels.native import paged_decode  # noqa: E402
from batchprefill.kernels.torch.ops import TorchOps  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SOURCES = native.SOURCES.resolve().relative_to(REPO).as_posix()  # the native sources' folder, as git names it


def revision_sources(revision: str, folder: Path, repo: Path | None = None) -> Path:
    """`revision`'s native sources (the .cpp files and the headers they include) unpacked under `folder`; their
    folder. The whole folder, not one file: paged_decode.cpp includes exp_nonpositive.h since session 47."""
    archive = subprocess.run(["git", "archive", revision, SOURCES], check=True, capture_output=True, cwd=repo).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / SOURCES


def built_ops(source: Path, library: Path, switched_off: list[str]) -> TorchOps:
    """TorchOps whose decode kernel is `source` built with the project's flags and `switched_off`."""
    subprocess.run([os.environ.get("CXX") or "c++", *native.FLAGS, *switched_off, "-o", str(library), str(source)],
                   check=True)
    ops = TorchOps()
    ops._paged = paged_decode.PagedDecode(ctypes.CDLL(str(library)))
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision whose paged_decode.cpp is the baseline")
    parser.add_argument("--switch-off", action="append", default=[], help="an extra compiler flag for both builds")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the pool and queries")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as folder:
        baseline_source = revision_sources(args.baseline, Path(folder)) / "paged_decode.cpp"
        builds = {args.baseline: built_ops(baseline_source, Path(folder) / "baseline.so", args.switch_off),
                  "this checkout": built_ops(native.SOURCES / "paged_decode.cpp", Path(folder) / "this.so",
                                             args.switch_off)}
        flags = " ".join(["-march=native", *args.switch_off])
        print(f"CPU: {cpu_model()}; both builds with {flags}; {args.dtype} pool and queries; 1 thread; ms a step")
        print(f"| case | {args.baseline}, in cache | this checkout, in cache | {args.baseline}, from memory "
              "| this checkout, from memory |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for groups, members, prefix, own, name in CASES:
            query, keys, values, meta = decode_batch(groups=groups, members=members, prefix=prefix, own=own)
            query = query.to(dtype).float()
            distinct = [((keys + 0.01 * i).to(dtype), (values - 0.01 * i).to(dtype)) for i in range(30)]
            row = []
            for pools in ([distinct[0]] * 30, distinct):
                best = dict.fromkeys(builds, float("inf"))
                for _ in range(args.rounds):
                    for label, ops in builds.items():
                        plan = ops.plan(meta, pools[0][0], HEADS, query.dtype)
                        best[label] = min(best[label], best_ms(ops, query, pools, plan))
                row += best.values()
            print(f"| {name} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")


if __name__ == "__main__":
    main()
