"""The input formats by `data.format` name, and the input a job names: its files, checked, in the format to read.

A new format is one module implementing `InputFormat` (batchprefill.io.input_format) and one line below.
"""

from __future__ import annotations

from pathlib import Path

from batchprefill.errors import JobError
from batchprefill.io.csv import CsvFormat
from batchprefill.io.hf_datasets import SavedDatasetFormat
from batchprefill.io.input_format import COMPRESSIONS, InputDataset, InputFormat, find_files, format_suffix
from batchprefill.io.jsonl import JsonLinesFormat
from batchprefill.io.openai_batch import OpenAIBatchFormat
from batchprefill.io.parquet import ParquetFormat

FORMATS: dict[str, InputFormat] = {fmt.name: fmt for fmt in [
    ParquetFormat(),
    SavedDatasetFormat(),
    JsonLinesFormat(),
    CsvFormat(),
    OpenAIBatchFormat(),
]}
DEFAULT = "parquet"  # data.format's default, under which an input's suffix may choose another format


def input_format(name: str) -> InputFormat:
    """The format `data.format` names, or the one-line JobError that lists them all."""
    if name not in FORMATS:
        *others, last = FORMATS
        raise JobError(f"data.format={name!r}: choose {', '.join(others)} or {last}")
    return FORMATS[name]


def resolve_input(path: str | None, name: str) -> tuple[list[Path], str]:
    """The files behind `data.input`, checked before anything runs, and the name of the format to open them in."""
    fmt = input_format(name)
    path = fmt.default_input() if path is None else path
    if name == DEFAULT:
        fmt = _by_suffix(path) or fmt
    files = fmt.find(path)
    fmt.check(files)
    return files, fmt.name


def open_dataset(files: list[Path], name: str) -> InputDataset:
    return input_format(name).open(files)


def _by_suffix(path: str) -> InputFormat | None:
    """The format chosen by suffix that `data.input` holds alone: a file or glob whose files all have its suffix,
    or a folder without a file of the default format that holds files of this format and of no other such one."""
    chosen = [fmt for fmt in FORMATS.values() if fmt.chosen_by_suffix]
    if Path(path).is_dir():
        if find_files(path, FORMATS[DEFAULT].suffix):
            return None
        held = [fmt for fmt in chosen if fmt.files_under(path)]
        return held[0] if len(held) == 1 else None
    files = find_files(path, "")
    suffixes = {format_suffix(file) for file in files}
    compressed = any(file.suffix in COMPRESSIONS for file in files)
    return next((fmt for fmt in chosen if suffixes == {fmt.suffix} and (fmt.compressed or not compressed)), None)
