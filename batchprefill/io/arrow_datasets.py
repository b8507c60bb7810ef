"""The pyarrow datasets the file formats open: a dataset scanned whole (Parquet, saved datasets), and text files
scanned one after another so that damage is named with its file (JSON Lines, CSV)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads

from batchprefill.errors import JobError
from batchprefill.io.own_files import UNREADABLE

READ_AHEAD_BATCHES = 2  # record batches decoded ahead of the one being read: memory does not follow the input


class ArrowDataset:
    """A pyarrow dataset scanned whole: Parquet files, or the tables of a saved dataset. What its bytes are is
    unknown here (a format that reads them says, by overriding `head_share`)."""

    def __init__(self, dataset: pads.Dataset):
        self.dataset = dataset
        self.schema = dataset.schema

    def count_rows(self) -> int:
        return self.dataset.count_rows()

    def to_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        """Files were checked up front; damage inside a file, or files whose columns disagree, surface here."""
        try:
            yield from self.dataset.to_batches(columns=columns, batch_size=batch_size,
                                               batch_readahead=READ_AHEAD_BATCHES, fragment_readahead=1)
        except UNREADABLE as error:
            raise JobError(f"data.input cannot be read: {error}; replace the damaged file") from error

    def head_share(self, rows: int) -> float | None:
        return None


class FileByFileDataset:
    """Text files (JSON Lines, CSV) under one schema, scanned one file after another, so that damage, which in a
    text file shows only when its line is parsed, is named with its file."""

    def __init__(self, files: list[Path], schema: pa.Schema, file_format: pads.FileFormat, label: str,
                 rows: int | None = None):
        self.files = files
        self.schema = schema
        self.file_format = file_format
        self.label = label
        self.rows = rows  # when the format counted them already

    def count_rows(self) -> int:
        if self.rows is None:
            self.rows = 0
            for file in self.files:
                try:
                    self.rows += self._dataset(file).count_rows()
                except UNREADABLE as error:
                    raise self._fault(file, error) from error
        return self.rows

    def to_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        for file in self.files:
            try:
                yield from self._dataset(file).to_batches(columns=columns, batch_size=batch_size,
                                                          batch_readahead=READ_AHEAD_BATCHES, fragment_readahead=1)
            except UNREADABLE as error:
                raise self._fault(file, error) from error

    def head_share(self, rows: int) -> float | None:
        return None

    def _dataset(self, file: Path) -> pads.Dataset:
        return pads.dataset(str(file), schema=self.schema, format=self.file_format)

    def _fault(self, file: Path, error: Exception) -> JobError:
        return JobError(f"data.input: {file} cannot be read as {self.label} ({error}); fix the file or leave it out "
                        "of data.input")
