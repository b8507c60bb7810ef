"""JSON Lines input (`data.format=jsonl`, or a `.jsonl` data.input): one JSON object per line, blank lines skipped.

pyarrow's JSON reader fixes a column's type on its first block, so a column that is null for the first thousand
lines and text after them would stop the scan midway. Opening the input therefore surveys it first: the files are
parsed a chunk of lines at a time (pyarrow's C++ reader, never a whole file in memory), the chunks' column types
unified and the rows counted; a line that is not a JSON object is named by file and line number before any row is
tokenized. The scan then reads every file under the one unified schema, a column null on every line as text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.json as pajson

from batchprefill.errors import JobError
from batchprefill.io.arrow_datasets import FileByFileDataset
from batchprefill.io.input_format import InputFormat, open_binary
from batchprefill.io.own_files import UNREADABLE

CHUNK_BYTES = 1 << 20  # of lines parsed at once while surveying: a few MB of Arrow, freed before the next


class JsonLinesFormat(InputFormat):
    name, label, suffix = "jsonl", "JSON Lines", ".jsonl"
    chosen_by_suffix = True
    compressed = True

    def check(self, files: list[Path]) -> None:
        """Each file's first chunk of lines is parsed: a file of another format under a .jsonl name is named
        before anything runs (damage further in is named when the input is opened)."""
        for file in files:
            first = next(_chunks(file), None)
            if first is not None:
                _parsed(file, *first)

    def open(self, files: list[Path]) -> FileByFileDataset:
        schema, rows, longest = None, 0, 0
        for file in files:
            for first_line, chunk in _chunks(file):
                table = _parsed(file, first_line, chunk)
                rows += table.num_rows
                longest = max(longest, max(map(len, chunk.split(b"\n"))))
                schema = table.schema if schema is None else _unified(file, schema, table.schema)
        if not rows:
            named = str(files[0]) if len(files) == 1 else f"all {len(files)} files ({files[0]}, ...)"
            raise JobError(f"data.input: {named} holds no JSON lines (empty); give a file with one JSON object a "
                           "line")
        schema = pa.schema([field.with_type(pa.string()) if pa.types.is_null(field.type) else field
                            for field in schema])
        read_options = pajson.ReadOptions(block_size=max(CHUNK_BYTES, 2 * longest))  # no line may straddle blocks
        file_format = pads.JsonFileFormat(parse_options=pajson.ParseOptions(explicit_schema=schema),
                                          read_options=read_options)
        return FileByFileDataset(files, schema, file_format, self.label, rows)


def _chunks(file: Path) -> Iterator[tuple[int, bytes]]:
    """The file in pieces of about CHUNK_BYTES that end where a line ends, each with its first line's number."""
    number = 1
    try:
        with open_binary(file) as handle:
            while chunk := handle.read(CHUNK_BYTES) + handle.readline():
                yield number, chunk
                number += chunk.count(b"\n")
    except OSError as error:
        raise JobError(f"data.input: {file} cannot be read: {error.strerror or error}") from error


def _parsed(file: Path, first_line: int, chunk: bytes) -> pa.Table:
    try:
        return pajson.read_json(pa.BufferReader(chunk), read_options=pajson.ReadOptions(block_size=len(chunk) + 1))
    except UNREADABLE as error:
        raise JobError(f"data.input: {file} {_bad_line(chunk, first_line) or f'cannot be read as JSON Lines ({error})'}"
                       "; fix the line or leave the file out of data.input") from error


def _bad_line(chunk: bytes, first_line: int) -> str | None:
    """The first line of a chunk pyarrow refused that is not a JSON object; None when each one is (their types
    disagree), as pyarrow's own message counts rows within its block, not lines."""
    for number, line in enumerate(chunk.split(b"\n"), first_line):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            return f"line {number} is not JSON: {error}"
        if not isinstance(value, dict):
            return f"line {number} is not a JSON object"
    return None


def _unified(file: Path, schema: pa.Schema, more: pa.Schema) -> pa.Schema:
    try:
        return pa.unify_schemas([schema, more], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise JobError(f"data.input: {file}: a column's values disagree in type between lines ({error}); give each "
                       "column one type") from error
