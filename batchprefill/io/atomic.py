"""Files that appear whole: written aside, flushed, then renamed over the target."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:  # matplotlib loads only where a figure is drawn
    from matplotlib.figure import Figure


def replace_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write` fills a staging file beside `path`, which then replaces it: a reader sees the whole file or none
    of it, even if this process is killed mid-write. A write that raises leaves `path` as it was and no staging
    file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(staging)
        with open(staging, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def write_atomic(table: pa.Table, path: Path) -> None:
    replace_atomic(path, lambda staging: pq.write_table(table, staging))


def save_png(figure: Figure, path: Path) -> None:
    """plan.png and stats/run.png, written as atomically as the Parquet files."""
    replace_atomic(path, lambda staging: figure.savefig(staging, format="png", dpi=110))


def write_records(records: list[dict], path: Path, schema: pa.Schema | None = None) -> None:
    write_atomic(pa.Table.from_pylist(records, schema=schema), path)
