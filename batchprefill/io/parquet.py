"""Parquet input: a file, a folder of `*.parquet` files at any depth, or a glob; every footer is read up front."""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq

from batchprefill.errors import JobError
from batchprefill.io.arrow_datasets import ArrowDataset
from batchprefill.io.input_format import InputFormat
from batchprefill.io.own_files import UNREADABLE

PARQUET_MAGIC = b"PAR1"  # a Parquet file starts and ends with it; the footer sits just before the last one
SHOWN_BYTES = 16  # of a file that is not Parquet, in the error: enough to recognise JSON, CSV, gzip, Arrow


class ParquetFormat(InputFormat):
    name, label, suffix = "parquet", "Parquet", ".parquet"

    def check(self, files: list[Path]) -> None:
        """Every input file's footer is read before anything runs (one small read per file), so a truncated file,
        or another format under a .parquet name, is named up front instead of failing the scan midway."""
        for file in files:
            reason = _parquet_fault(file)
            if reason is not None:
                raise JobError(f"data.input: {file} {reason}; replace the file or leave it out of data.input")

    def open(self, files: list[Path]) -> ParquetDataset:
        """Read without pre-buffering: with it, pyarrow's scanner keeps what it read and memory grows with the file
        (apache/arrow#39808; 2.2 GB after 1M prompts, 0.5 GB without)."""
        options = pads.ParquetFragmentScanOptions(pre_buffer=False)
        return ParquetDataset(pads.dataset([str(f) for f in files],
                                           format=pads.ParquetFileFormat(default_fragment_scan_options=options)))


class ParquetDataset(ArrowDataset):
    def head_share(self, rows: int) -> float | None:
        """The share of the input's uncompressed Parquet bytes in its first `rows` rows, from the row groups' sizes
        in the footers (rows within a row group taken as equal)."""
        groups = []  # (rows, bytes) of every row group, in reading order
        for fragment in self.dataset.get_fragments():
            metadata = fragment.metadata
            groups += [(group.num_rows, group.total_byte_size)
                       for group in map(metadata.row_group, range(metadata.num_row_groups))]
        head, left = 0.0, rows
        for group_rows, size in groups:
            taken = min(left, group_rows)
            head += size * taken / max(group_rows, 1)
            left -= taken
            if not left:
                break
        total = sum(size for _, size in groups)
        return head / total if head and total else None


# What a file that is not Parquet looks like from its first bytes, and how to read it: (test, words).
LOOKALIKES = [
    (lambda head, suffix: head.startswith(b"\x1f\x8b"),
     "gzip-compressed data: name it .jsonl.gz or .csv.gz to read JSON Lines or CSV"),
    (lambda head, suffix: head.startswith(b"BZh"),
     "bzip2-compressed data: name it .jsonl.bz2 or .csv.bz2 to read JSON Lines or CSV"),
    (lambda head, suffix: head.lstrip().startswith(b"["),
     "a JSON array: write one JSON object a line (JSON Lines, a .jsonl file or data.format=jsonl)"),
    (lambda head, suffix: head.lstrip().startswith(b"{"), "JSON Lines: name it .jsonl or set data.format=jsonl"),
    (lambda head, suffix: suffix in (".tsv", ".tab") or b"\t" in head,
     "tab-separated text: CSV input is comma-separated (a .csv file or data.format=csv)"),
    (lambda head, suffix: head.startswith(b"ARROW1"), "an Arrow IPC file: write it as Parquet"),
]


def _what_it_looks_like(file: Path, head: bytes) -> str:
    """What a file that is not Parquet seems to be, from its first bytes and suffix, and how to read it."""
    words = next((words for looks, words in LOOKALIKES if looks(head, file.suffix)), None)
    return f", which looks like {words}" if words else ""


def _parquet_fault(file: Path) -> str | None:
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(SHOWN_BYTES)
            handle.seek(max(size - len(PARQUET_MAGIC), 0))
            tail = handle.read(len(PARQUET_MAGIC))
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    if size == 0:
        return "is empty (0 bytes)"
    if tail != PARQUET_MAGIC:
        if head.startswith(PARQUET_MAGIC):
            return "is cut short: it starts as Parquet but has no footer"
        return f"is not Parquet: it starts with {head!r}{_what_it_looks_like(file, head)}"
    try:
        pq.read_metadata(file)
    except UNREADABLE as error:
        return f"has a damaged footer: {error}"
    return None
