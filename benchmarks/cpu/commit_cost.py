"""What a results part's commit costs now that the rename is flushed too (issue 28), against the commit before it
(data flushed, renamed, the folder entry not flushed), side by side in one process, alternating.

    python benchmarks/cpu/commit_cost.py --dir /tmp/commit-bench --parts 40 --rows 512

A part of `--rows` rows of about 1 KiB each (a prompt and an output), as `output.commit_every_rows=512` writes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchprefill.io import atomic


def old_commit(table: pa.Table, path: Path) -> None:
    """The commit before issue 28: written aside, flushed, renamed."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, staging)
        with open(staging, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--parts", type=int, default=40)
    parser.add_argument("--rows", type=int, default=512)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [f"row-{i:06d}" for i in range(args.rows)],
                      "prompt": [f"Question {i}: " + "word " * 120 for i in range(args.rows)],
                      "output_text": [f"Answer {i}: " + "token " * 60 for i in range(args.rows)]})
    times: dict[str, list[float]] = {"old": [], "new": []}
    for part in range(args.parts):
        for name, commit in (("old", old_commit), ("new", atomic.write_atomic)):
            started = time.perf_counter()
            commit(table, args.dir / f"part-{name}-{part:05d}.parquet")
            times[name].append(time.perf_counter() - started)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{args.parts} parts of {args.rows} rows ({table.nbytes / 1024:.0f} KiB in Arrow) in {args.dir}: median "
          f"commit {old * 1e3:.2f} ms before, {new * 1e3:.2f} ms now (folder flushed too), now/before {new / old:.2f}")


if __name__ == "__main__":
    main()
