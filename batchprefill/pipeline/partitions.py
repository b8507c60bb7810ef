"""Stream the input once: tokenize in batches, turn bad rows into errors, and spill rows into partitions.

With `data.order=prefix`, a row's partition is a hash of its namespace and first full KV block, so
prompts that share any block always land together and each partition can be sorted on its own; with
`data.order=input` partitions are contiguous ranges of rows. Partitions are Parquet files under the
output folder, written once and reused by every shard and every resumed run.

Reading, tokenizing and spilling overlap, so preparing takes about the tokenizer's time: the input is
decoded once, a few record batches ahead, tokenized on every core, and spilled as the tokenizer works.

Memory is bounded whatever the input's size: a few record batches are in flight at a time, rows wait for
their partition file in buffers with a fixed total, and partitions are made small enough that the
largest, read back and ordered, fits `data.buffer_mb`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from batchprefill.errors import JobError
from batchprefill.io.atomic import disk_full_named, fsync_dir, fsync_file
from batchprefill.io.columns import INTERNAL_PREFIX, NAMESPACE, ROW, TOKENS, check_columns
from batchprefill.io.formats import open_dataset
from batchprefill.io.input_format import InputDataset, record_batches
from batchprefill.io.unique_ids import check_unique_ids
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pipeline.manifest import (
    MANIFEST_NAME,
    Manifest,
    PrepareSettings,
    locked,
    partition_path,
    read_manifest,
    recipe_fingerprint,
    write_manifest,
)
from batchprefill.pipeline.tokenize import TOKENIZE_THREADS, tokenized_tables
from batchprefill.units import readable_bytes

# Peak memory while one partition is read back and ordered, per byte of its Arrow table: Parquet decoding,
# the table, the sort key (a copy of the token ids), the table taken in run order, the comparison scratch
# (measured 4.0 to 4.7 on benchmarks/cpu/planning_scale.py's partitions).
RUN_EXPANSION = 5
# Partitions are aimed at this size even when the buffer allows more: smaller ones lose no cache hits
# (a prefix group never spans two) and let shards balance; hash skew can make one several times larger.
PARTITION_TARGET_BYTES = 64 << 20
SPILL_BUFFER_SHARE = 8  # rows waiting for their partition file hold at most data.buffer_mb / 8 in all
# The ids are checked in a pass of their own that reads only their column (a fraction of the input's bytes),
# so a repeated or null id fails the job before any prompt is tokenized.
ID_READ_ROWS = 1 << 16  # 1 << 20 let pyarrow's scanner read ahead to 800 MB on 50M string ids; this, 130 MB


def make_partitions(files: list[Path], fmt: str, settings: PrepareSettings, tokenizer: PromptTokenizer,
            folder: Path, progress: bool = True, workers: int = TOKENIZE_THREADS) -> Manifest:
    """Partitions for this input and these settings, made now unless an earlier run left them complete.

    Any number of tokenizing `workers` makes the same partitions, row for row.
    """
    fingerprint = recipe_fingerprint(files, settings)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder.parent / ".prepare.lock"):
        if (folder / MANIFEST_NAME).exists():
            manifest = read_manifest(folder)
            if manifest.fingerprint == fingerprint:
                return manifest
            shutil.rmtree(folder)  # the input or the settings changed: earlier partitions are stale
        staging = folder.with_name(folder.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with disk_full_named(staging):
                staging.mkdir(parents=True)
                manifest = _spill(files, fmt, settings, tokenizer, staging, fingerprint, progress, workers)
                write_manifest(staging, manifest)
                _flush_folder(staging)
        except BaseException:  # a full disk gets its room back; a rerun would remove the staging folder anyway
            shutil.rmtree(staging, ignore_errors=True)
            raise
        staging.rename(folder)
        fsync_dir(folder.parent)
        return manifest


def _flush_folder(folder: Path) -> None:
    """The partitions and the manifest on disk before the folder is renamed into place: a power loss cannot leave
    a manifest over partitions that were never written."""
    for file in folder.iterdir():
        if file.is_file():
            fsync_file(file)
    fsync_dir(folder)


def _spill(files, fmt, settings: PrepareSettings, tokenizer, staging: Path, fingerprint: str,
           progress: bool, workers: int) -> Manifest:
    """One pass over the input in three overlapping stages: pyarrow's scanner decodes the next record batches,
    `workers` threads tokenize, and this thread spills each tokenized batch, in input order, to its partitions."""
    dataset = open_dataset(files, fmt)
    check_columns(dataset.schema, settings.columns, settings.chat_template)
    num_rows = dataset.count_rows()
    if num_rows == 0:
        raise JobError("the input has no rows")
    if settings.columns.id in dataset.schema.names:  # when absent, the row's position is its id: unique by itself
        ids = record_batches(dataset, ID_READ_ROWS, [settings.columns.id])
        check_unique_ids((batch.column(0) for batch in ids), settings.columns.id, staging / "ids", num_rows)
    bar = tqdm(total=num_rows, desc="tokenize", unit="row", disable=not progress)
    with tokenized_tables(dataset, settings, tokenizer, workers) as tables:
        first = next(tables)
        num_partitions = _num_partitions(_expected_bytes(dataset, first, num_rows), settings)
        files_out = _PartitionFiles(staging, num_partitions, (settings.buffer_mb << 20) // SPILL_BUFFER_SHARE)
        digest = InputDigest()
        try:
            for table in itertools.chain([first], tables):
                files_out.add(table, _partition_of(table, num_partitions, num_rows, settings))
                digest.add(table)
                bar.update(table.num_rows)
            files_out.finish()
        finally:
            bar.close()
            files_out.close()
    _warn_oversized(files_out.bytes, settings.buffer_mb)
    return Manifest(fingerprint, sum(files_out.rows), files_out.rows, files_out.tokens, files_out.bytes,
                    digest.hexdigest())


class InputDigest:
    """A digest of every input row's values (the user's columns, not what preparing adds), in input order, whatever
    the record batches' sizes: a resume compares it to tell a changed input from the same rows written again
    (job_record.py). One JSON line per row: 5.9 us a row (an id and a 70-character prompt), against the
    tokenizer's 1.25 ms (20k prompts in 25 CPU s)."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def add(self, table: pa.Table) -> None:
        rows = table.select([name for name in table.column_names if not name.startswith(INTERNAL_PREFIX)])
        for row in rows.to_pylist():
            self.digest.update(json.dumps(row, sort_keys=True, default=repr).encode() + b"\n")

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def _expected_bytes(dataset: InputDataset, first: pa.Table, num_rows: int) -> float:
    """The tokenized input's Arrow bytes, guessed from its first batch without reading the rest: scaled by rows,
    or by the share of the input's bytes that the format's metadata (Parquet footers) put in those rows, whichever
    is larger.

    Rows alone miss a head of short prompts; footers alone miss a tail that Parquet's dictionary encoding
    shrinks but Arrow holds in full. Measuring exactly took a decoding pass (0.5 CPU s per 20k prompts against
    the tokenizer's 25, but alone on the critical path).
    """
    by_rows = first.nbytes * num_rows / first.num_rows
    share = dataset.head_share(first.num_rows)
    return by_rows if share is None else max(by_rows, first.nbytes / share)


def _num_partitions(expected_bytes: float, settings: PrepareSettings) -> int:
    """Enough partitions that a typical one, ordered in memory, takes a fraction of data.buffer_mb."""
    target = min(PARTITION_TARGET_BYTES, (settings.buffer_mb << 20) / RUN_EXPANSION)
    return max(settings.min_partitions, math.ceil(expected_bytes / target))


def _warn_oversized(partition_bytes: list[int], buffer_mb: int) -> None:
    """A prefix group is never split, so one first block shared by most of the data makes a large partition."""
    largest = max(partition_bytes, default=0)
    if largest * RUN_EXPANSION > buffer_mb << 20:
        print(f"batchprefill: warning: partition {partition_bytes.index(largest)} holds {readable_bytes(largest)} "
              f"of prompts that share their first block; ordering it needs about "
              f"{readable_bytes(largest * RUN_EXPANSION)}, more than data.buffer_mb={buffer_mb}", file=sys.stderr)


def _partition_of(table: pa.Table, num_partitions: int, num_rows: int, settings: PrepareSettings) -> np.ndarray:
    rows = table[ROW].to_numpy()
    if num_partitions == 1:
        return np.zeros(len(rows), dtype=np.int64)
    if settings.order == "input":
        return rows * num_partitions // max(num_rows, 1)
    return (_first_block_hash(table, settings.block_size) % np.uint64(num_partitions)).astype(np.int64)


_FNV_PRIME = np.uint64(0x100000001B3)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)


def _first_block_hash(table: pa.Table, block_size: int) -> np.ndarray:
    """A 64-bit hash per row of (namespace, first full block), computed for the whole batch at once.

    A row with no full block shares no cached block with anyone, so it is spread by its row number instead.
    """
    tokens = table[TOKENS].combine_chunks()
    offsets = tokens.offsets.to_numpy().astype(np.int64)
    values = tokens.values.to_numpy()
    full = np.diff(offsets) >= block_size
    hashes = table[ROW].to_numpy().astype(np.uint64)
    block = values[offsets[:-1][full, None] + np.arange(block_size)].astype(np.uint64)
    keyed = np.full(len(block), _FNV_OFFSET) ^ _namespace_hashes(table[NAMESPACE])[full]
    for column in block.T:
        keyed = (keyed ^ column) * _FNV_PRIME
    hashes[full] = keyed
    return _mix(hashes)


def _namespace_hashes(namespaces: pa.ChunkedArray) -> np.ndarray:
    """A stable 64-bit hash per row of its namespace; only the distinct names are hashed in Python."""
    encoded = pc.dictionary_encode(namespaces.combine_chunks())
    names = np.array([int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
                      for name in encoded.dictionary.to_pylist()], dtype=np.uint64)
    return names[encoded.indices.to_numpy(zero_copy_only=False)]


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches the low bits that `% num_partitions` keeps."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class _PartitionFiles:
    """Rows to their partitions' Parquet files, through buffers that together stay under `budget` bytes.

    Every Parquet write makes a row group, so writing each batch's share at once would make row groups of a
    few rows; a partition's rows wait until it holds budget / partitions bytes, then go out in one write.
    Every partition gets a file, an empty one if no row hashes to it, so readers need not check.
    """

    def __init__(self, folder: Path, count: int, budget: int):
        self.folder = folder
        self.limit = max(1, budget // count)
        self.rows = [0] * count
        self.tokens = [0] * count
        self.bytes = [0] * count
        self.pending: list[list[pa.Table]] = [[] for _ in range(count)]
        self.pending_bytes = [0] * count
        self.writers: dict[int, pq.ParquetWriter] = {}
        self.schema: pa.Schema | None = None

    def add(self, table: pa.Table, parts: np.ndarray) -> None:
        self.schema = table.schema
        order = np.argsort(parts, kind="stable")
        bounds = np.searchsorted(parts[order], np.arange(len(self.rows) + 1))
        lengths = pc.list_value_length(table[TOKENS]).to_numpy(zero_copy_only=False)
        tokens = np.bincount(parts, weights=lengths, minlength=len(self.rows))
        for part in np.flatnonzero(np.diff(bounds)):
            piece = table.take(order[bounds[part] : bounds[part + 1]])  # a compact copy: the batch can go
            self.pending[part].append(piece)
            self.pending_bytes[part] += piece.nbytes
            self.rows[part] += piece.num_rows
            self.tokens[part] += int(tokens[part])
            self.bytes[part] += piece.nbytes
            if self.pending_bytes[part] >= self.limit:
                self._flush(int(part))

    def _flush(self, part: int) -> None:
        table = pa.concat_tables(self.pending[part]) if self.pending[part] else self.schema.empty_table()
        if part not in self.writers:
            self.writers[part] = pq.ParquetWriter(partition_path(self.folder, part), table.schema)
        self.writers[part].write_table(table)
        self.pending[part] = []
        self.pending_bytes[part] = 0

    def finish(self) -> None:
        """Write what still waits, and an empty file for every partition no row went to."""
        for part in range(len(self.rows)):
            if self.pending[part] or part not in self.writers:
                self._flush(part)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
