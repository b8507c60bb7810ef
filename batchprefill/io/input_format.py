"""What an input format is, behind one small interface.

A format says how to find its files under `data.input`, how to check them before anything runs, how to open them
as one dataset streamed in record batches, which columns it reads, what it knows of its bytes for the size
estimate, and what it writes once the job's results are complete. One module per format implements it
(`parquet`, `hf_datasets`, `jsonl`, `csv`, `openai_batch`); `batchprefill.io.formats` registers them by name.
This module imports nothing heavier than pyarrow itself (pyarrow.dataset alone adds 60 MB of RSS), so a format
that streams on its own, as the OpenAI batch reader does, stays light.
"""

from __future__ import annotations

import bz2
import glob
import gzip
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from batchprefill.errors import JobError
from batchprefill.io.columns import Columns

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "data_samples"
# Compressed text a format may read (`prompts.jsonl.gz`): the suffixes pyarrow's datasets decompress by, and how
# Python opens them for the formats that survey their files line by line first.
COMPRESSIONS: dict[str, Callable] = {".gz": gzip.open, ".bz2": bz2.open}


class InputDataset(Protocol):
    """An opened input: its schema, its row count, its rows in record batches, and what it knows of its bytes."""

    schema: pa.Schema

    def count_rows(self) -> int: ...

    def to_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        """Batches of at most `batch_size` rows in input order, with read-ahead kept bounded; a fault found
        while reading is a JobError."""
        ...

    def head_share(self, rows: int) -> float | None:
        """The share of the input's bytes in its first `rows` rows, from metadata alone; None when unknown."""
        ...


class InputFormat:
    """A format of `data.input`; the defaults fit a table whose columns the `data.*_column` keys name."""

    name = ""  # the data.format value
    label = ""  # what its files are called in messages: "no Parquet files found"
    suffix = ""  # of its files, sought under a folder
    # Read as this format when data.format is left at its default and every input file has the suffix. Such a
    # format has no fixed columns and writes nothing at completion: the merge, which reads no input, knows only
    # data.format.
    chosen_by_suffix = False
    # True: its rows' prompt, messages and id columns are its own, and the keys that would name them (and a
    # task's other columns, as data.choices_column) are not read
    fixed_columns = False
    # The tasks its rows may name in their own column (Columns.row_task): their result columns are all written.
    row_tasks: tuple[str, ...] = ()
    compressed = False  # its files may be compressed (COMPRESSIONS: `.jsonl.gz`, `.csv.bz2`)

    def default_input(self) -> str:
        """What a job reads when data.input is not given: the shipped sample."""
        if not SAMPLE_DIR.exists():
            raise JobError("no data.input given and the shipped sample folder is not installed; set data.input")
        return str(SAMPLE_DIR / "prompts.parquet")

    def find(self, path: str) -> list[Path]:
        """The files `data.input` names, or a JobError when it names none."""
        files = self.files_under(path)
        if not files:
            raise JobError(f"data.input {path}: no {self.label} files found")
        return files

    def files_under(self, path: str) -> list[Path]:
        """The files `data.input` names: itself, a glob's matches, or a folder's files with this format's suffix
        (compressed too, when the format reads compressed files)."""
        if not Path(path).is_dir() or not self.compressed:
            return find_files(path, self.suffix)
        return sorted(file for ending in ("", *COMPRESSIONS) for file in find_files(path, self.suffix + ending))

    def check(self, files: list[Path]) -> None:
        """Read what is cheap to read of every file before anything runs, so a damaged one is named up front."""

    def open(self, files: list[Path]) -> InputDataset:
        """The files as one dataset, streamed in record batches; every format says how."""
        raise NotImplementedError

    def columns(self, given: Columns) -> Columns:
        """The columns a job reads, from those the data.*_column keys name."""
        return given

    def finish_outputs(self, out_dir: Path, model: str, token_text: Callable[[int], str]) -> None:
        """Write what this format adds to `out_dir` once every row has its result (a run of one shard, or the
        merge of all shards); `token_text` names a token id, loading the tokenizer at its first call."""


def find_files(path: str, suffix: str) -> list[Path]:
    """The files a `data.input` names: itself, the files ending in `suffix` at any depth under a folder, or a
    glob's matches; a folder is never taken for a file, whatever its name."""
    target = Path(path)
    if target.is_dir():
        files = sorted(target.rglob(f"*{suffix}"))
    elif any(ch in path for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True))
    else:
        files = [target] if target.exists() else []
    return [file for file in files if file.is_file()]


def format_suffix(file: Path) -> str:
    """The suffix that says a file's format, under any compression suffix: `.jsonl` for `prompts.jsonl.gz`."""
    return Path(file.stem).suffix if file.suffix in COMPRESSIONS else file.suffix


def open_binary(file: Path):
    """A file's bytes, decompressed when its suffix says it is compressed."""
    return COMPRESSIONS.get(file.suffix, open)(file, "rb")


def record_batches(dataset: InputDataset, rows: int, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The way preparing reads its input: batches of at most `rows` rows, read ahead a bounded amount."""
    return dataset.to_batches(columns=columns, batch_size=rows)
