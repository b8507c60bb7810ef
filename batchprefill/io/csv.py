"""CSV input (`data.format=csv`, or a `.csv` data.input): a header line naming the columns, then one row a record;
a quoted value may span lines (a prompt with newlines in it).

A column's type is what pyarrow infers from the first block (1 MB) of each file, unified over the files; a column
empty there is read as text, which pyarrow would type null and stop at its first value. A value that later
disagrees with its column's type (text in a column of numbers) stops the job with one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as pads

from batchprefill.errors import JobError
from batchprefill.io.arrow_datasets import FileByFileDataset
from batchprefill.io.input_format import InputFormat, open_binary
from batchprefill.io.own_files import UNREADABLE

PARSE = pacsv.ParseOptions(newlines_in_values=True)


class CsvFormat(InputFormat):
    name, label, suffix = "csv", "CSV", ".csv"
    chosen_by_suffix = True
    compressed = True  # pyarrow decompresses `.csv.gz` and `.csv.bz2` by their suffix

    def check(self, files: list[Path]) -> None:
        """Each file's header and first block are parsed before anything runs."""
        for file in files:
            _first_block_schema(file)

    def open(self, files: list[Path]) -> FileByFileDataset:
        try:
            schema = pa.unify_schemas([_first_block_schema(file) for file in files], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise JobError(f"data.input: the CSV files' columns disagree in type ({error}); give each column one "
                           "type in every file") from error
        schema = pa.schema([field.with_type(pa.string()) if pa.types.is_null(field.type) else field
                            for field in schema])
        file_format = pads.CsvFileFormat(parse_options=PARSE, convert_options=pacsv.ConvertOptions(
            column_types=schema))
        return FileByFileDataset(files, schema, file_format, self.label)


def _first_block_schema(file: Path) -> pa.Schema:
    try:
        with open_binary(file) as handle, pacsv.open_csv(handle, parse_options=PARSE) as reader:
            return reader.schema
    except UNREADABLE as error:
        raise JobError(f"data.input: {file} cannot be read as CSV with a header line ({error}); fix the file or "
                       "leave it out of data.input") from error
