"""The job's own Parquet files read back (partitions, results parts, statistics), with one-line faults."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchprefill.errors import JobError

# What a damaged or foreign file raises while read; not MemoryError and the like, which are no fault of the file.
UNREADABLE = (OSError, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)


def read_parquet(path: Path, columns: list[str] | None, remedy: str) -> pa.Table:
    """One of the job's own Parquet files (a partition, a results part, statistics), or a JobError naming it:
    damaged, with `remedy`; without a column asked for, with the config key to check."""
    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[name for name in columns or names if name in names])
    except UNREADABLE as error:
        raise JobError(f"{path} cannot be read ({error}); {remedy}") from error
    missing = [name for name in columns or [] if name not in names]
    if missing:
        raise JobError(f"{path} has no column {missing[0]!r} (it has: {', '.join(names)}); give this command the "
                       "data.id_column (and other data.* keys) of the run that wrote it")
    return table
