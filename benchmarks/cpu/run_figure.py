"""What drawing stats/run.png costs, from a short run's statistics up to a million steps.

    python benchmarks/cpu/run_figure.py                        # 1k, 100k and 1M steps, one process, side by side

Each size gets a synthetic stats folder (every column the figure reads; a tenth as many prefix groups as
steps), then `write_run_figure` is timed three times on it and the best time is reported, with the time to
read the steps table alone beside it: the figure bins steps into at most 2,000 points and draws at most 5,000
groups, so what grows with the run is the reading and the binning, not the drawing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchprefill.report.run_figure import write_run_figure  # noqa: E402
from tests.test_run_figure import synthetic_stats  # noqa: E402

REPEATS = 3


def best_of(repeats: int, task: Callable[[Path], object], stats: Path) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        task(stats)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    args = parser.parse_args()
    print("| steps | groups | read steps.parquet s | write_run_figure s |")
    print("|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for steps in args.steps:
            stats = synthetic_stats(Path(scratch) / f"stats-{steps}", num_steps=steps, num_groups=max(steps // 10, 1))
            read = best_of(REPEATS, lambda folder: pq.read_table(folder / "steps.parquet"), stats)
            draw = best_of(REPEATS, lambda folder: write_run_figure(folder, "benchmark"), stats)
            print(f"| {steps:,} | {max(steps // 10, 1):,} | {read:.2f} | {draw:.2f} |")


if __name__ == "__main__":
    main()
