"""Every row's id must be present and distinct: resume skips rows by id and the merge counts results by id, so a
repeated id loses a row without a word, and a null id can be neither skipped nor counted.

Memory stays bounded whatever the input's size, and no id is ever held in a Python set: each id is hashed into
one of enough buckets that each holds about `bucket_bytes`, buckets wait on disk as Arrow IPC files (a small
input's one bucket never leaves memory), and each bucket is then sorted on its own; equal ids always share a
bucket. `IdBuckets` takes any stream of id arrays in input order, so a reader whose repeated ids are row errors
rather than a job fault (OpenAI batch files: a duplicate `custom_id` is a line error) uses `repeats()` directly.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchprefill.errors import JobError

ID, ROW, FIRST_ROW = "id", "row", "first_row"
BUCKET_BYTES = 64 << 20  # ids and row numbers per bucket; sorting one takes a few times this
PENDING_BYTES = 32 << 20  # ids waiting for their bucket file, all buckets together
SHOWN_CHARS = 60  # of an offending id, in the error line


class IdBuckets:
    """Ids in input order, spread over buckets by hash, for finding nulls and repeats in bounded memory."""

    def __init__(self, folder: Path, expected_rows: int, label: str = "ids", bucket_bytes: int = BUCKET_BYTES,
                 pending_bytes: int = PENDING_BYTES):
        self.folder = folder
        self.label = label  # names the ids in an error: their type is wrong
        self.expected_rows = expected_rows
        self.bucket_bytes = bucket_bytes
        self.pending_bytes = pending_bytes
        self.rows = 0  # rows added so far: the next row's number
        self.nulls = 0
        self.first_null: int | None = None
        self.schema: pa.Schema | None = None  # set, with the bucket count, by the first non-null ids
        self.pending: list[list[pa.Table]] = []
        self.waiting: list[int] = []
        self.writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        self.spilled: set[int] = set()  # buckets with a file, once their writers are closed

    @property
    def num_buckets(self) -> int:
        return len(self.pending)

    def add(self, ids: pa.Array | pa.ChunkedArray) -> None:
        """The ids of the next rows of the input."""
        ids = self._scalar(ids)
        rows = np.arange(self.rows, self.rows + len(ids), dtype=np.int64)
        self.rows += len(ids)
        if ids.null_count:
            valid = ids.is_valid().to_numpy(zero_copy_only=False)
            if self.first_null is None:
                self.first_null = int(rows[np.argmin(valid)])
            self.nulls += ids.null_count
            ids, rows = ids.filter(pa.array(valid)), rows[valid]
        if not len(ids):
            return
        if self.schema is None:
            self._size(ids)
        ids = ids.cast(self.schema.field(ID).type)  # equal ids hash alike only at one type
        table = pa.table({ID: ids, ROW: rows})
        if self.num_buckets == 1:
            self._queue(0, table)
            return
        import polars as pl  # 30 MB of RSS, needed only once the ids span several buckets

        buckets = (pl.from_arrow(ids).hash(seed=0).to_numpy() % np.uint64(self.num_buckets)).astype(np.int64)
        order = np.argsort(buckets, kind="stable")
        bounds = np.searchsorted(buckets[order], np.arange(self.num_buckets + 1))
        for bucket in np.flatnonzero(np.diff(bounds)):
            self._queue(int(bucket), table.take(order[bounds[bucket] : bounds[bucket + 1]]))

    def _size(self, ids: pa.Array) -> None:
        """Enough buckets for the whole input at the first ids' bytes per row; the folder for those that spill."""
        self.schema = pa.schema([(ID, ids.type), (ROW, pa.int64())])
        per_row = ids.nbytes / len(ids) + np.dtype(np.int64).itemsize
        count = max(1, math.ceil(self.expected_rows * per_row / self.bucket_bytes))
        self.pending = [[] for _ in range(count)]
        self.waiting = [0] * count
        if count > 1:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _queue(self, bucket: int, table: pa.Table) -> None:
        self.pending[bucket].append(table)
        self.waiting[bucket] += table.nbytes
        if self.num_buckets > 1 and self.waiting[bucket] >= self.pending_bytes // self.num_buckets:
            if bucket not in self.writers:
                self.writers[bucket] = pa.ipc.new_file(self._path(bucket), self.schema)
            self.writers[bucket].write_table(pa.concat_tables(self.pending[bucket]))
            self.pending[bucket], self.waiting[bucket] = [], 0

    def _path(self, bucket: int) -> Path:
        return self.folder / f"ids-{bucket:05d}.arrow"

    def repeats(self) -> Iterator[pa.Table]:
        """Per bucket, every row whose id an earlier row already had: its id, its row, and the id's first row.

        Call once, after the last `add`; the spilled buckets are read one at a time.
        """
        self._close_writers()
        for bucket in range(self.num_buckets):
            tables = self.pending[bucket]
            if bucket in self.spilled:
                with pa.OSFile(str(self._path(bucket))) as source:
                    tables = [pa.ipc.open_file(source).read_all(), *tables]
            self.pending[bucket] = []
            if tables:
                yield _repeats_in(pa.concat_tables(tables))

    def _close_writers(self) -> None:
        for bucket, writer in self.writers.items():
            writer.close()
            self.spilled.add(bucket)
        self.writers = {}

    def close(self) -> None:
        """Remove what was spilled."""
        self._close_writers()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _scalar(self, ids: pa.Array | pa.ChunkedArray) -> pa.Array:
        """One array of plain values: dictionary-encoded ids decoded; lists, structs and maps cannot be sorted."""
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        if pa.types.is_dictionary(ids.type):
            ids = ids.dictionary_decode()
        if pa.types.is_nested(ids.type):
            raise JobError(f"{self.label} must be strings or numbers, not {ids.type}")
        return ids


def _repeats_in(table: pa.Table) -> pa.Table:
    """Sorted by (id, row), a row repeats an earlier one exactly when its id equals the id just before it."""
    table = table.sort_by([(ID, "ascending"), (ROW, "ascending")])
    ids = table[ID].combine_chunks()
    rows = table[ROW].to_numpy()
    same = np.zeros(len(ids), dtype=bool)
    if len(ids) > 1:
        same[1:] = pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)
    first = np.maximum.accumulate(np.where(same, 0, np.arange(len(ids))))  # where each run of equal ids starts
    return pa.table({ID: ids.filter(pa.array(same)), ROW: rows[same], FIRST_ROW: rows[first[same]]})


@dataclass
class IdReport:
    """What is wrong with a column of ids, summed over its buckets."""

    column: str
    nulls: int
    first_null: int | None
    repeated_rows: int = 0  # rows whose id an earlier row already had
    repeated_ids: int = 0  # distinct ids that more than one row has
    first_repeat: tuple[object, int, int] | None = None  # (id, row, the id's first row) of the earliest repeat

    def add_repeats(self, repeats: pa.Table) -> None:
        if not repeats.num_rows:
            return
        rows = repeats[ROW].to_numpy()
        self.repeated_rows += len(rows)
        self.repeated_ids += len(np.unique(repeats[FIRST_ROW].to_numpy()))
        earliest = int(np.argmin(rows))
        if self.first_repeat is None or rows[earliest] < self.first_repeat[1]:
            self.first_repeat = (repeats[ID][earliest].as_py(), int(rows[earliest]),
                                 int(repeats[FIRST_ROW][earliest].as_py()))

    def message(self) -> str | None:
        """The one line that names the column, the first offending value and how many; None when all is well."""
        problems = []
        if self.first_repeat is not None:
            value, row, first = self.first_repeat
            shown = repr(value) if len(repr(value)) <= SHOWN_CHARS else repr(value)[:SHOWN_CHARS] + "..."
            verb = "repeats" if self.repeated_rows == 1 else "repeat"
            problems.append(f"{self.repeated_rows} {_rows(self.repeated_rows)} {verb} an earlier row's id "
                            f"({self.repeated_ids} distinct {'id' if self.repeated_ids == 1 else 'ids'}; first: "
                            f"{shown} at row {row + 1}, also at row {first + 1})")
        if self.first_null is not None:
            problems.append(f"{self.nulls} {_rows(self.nulls)} {'has' if self.nulls == 1 else 'have'} a null id "
                            f"(first: row {self.first_null + 1})")
        if not problems:
            return None
        return (f"data.id_column={self.column!r} must give every row its own id: {'; '.join(problems)}. Rows "
                "count from 1 in input order, as a file's lines do. Fix the ids, or set data.id_column to a column "
                "the input lacks to key rows by position")


def _rows(count: int) -> str:
    return "row" if count == 1 else "rows"


def check_unique_ids(batches: Iterable[pa.Array | pa.ChunkedArray], column: str, folder: Path,
                     expected_rows: int) -> None:
    """Raise a JobError unless every id of the stream is non-null and distinct; spills into `folder`, then
    removes it."""
    buckets = IdBuckets(folder, expected_rows, f"data.id_column={column!r}: ids")
    try:
        for ids in batches:
            buckets.add(ids)
        report = IdReport(column, buckets.nulls, buckets.first_null)
        for repeats in buckets.repeats():
            report.add_repeats(repeats)
    finally:
        buckets.close()
    message = report.message()
    if message is not None:
        raise JobError(message)
