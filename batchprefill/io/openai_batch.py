"""OpenAI Batch API files in (`data.format=openai_batch`): JSONL files of request lines, streamed as Arrow record
batches; `results.jsonl` out once the job is complete (`batchprefill.io.openai_results`).

Every non-blank line becomes one row, a bad line included (`batchprefill.io.openai_lines`): its row carries
`error_code` and `error_message`, never runs, and gets an error line in `results.jsonl`. A row's `custom_id` is
its id; a line without a usable one (not JSON, no custom_id, or one an earlier line already used) gets
`#line-<n>` (n counts lines from 1), so ids stay unique and a rerun gives the same ids.

Repeated custom_ids are found before the first batch, in a pass over the lines' ids through the same check as
`data.id_column`'s (`batchprefill.io.unique_ids`: exact, spilling buckets of ids to a temporary folder), so
memory is bounded by one batch of lines plus 8 bytes per repeated line. Measured on a million lines (a 197 MB
file): peak RSS 178 MB, of which 11 MB came after the first batch; reading it took 17 s, 8 of them the id pass.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchprefill.errors import JobError
from batchprefill.io.columns import Columns
from batchprefill.io.input_format import InputFormat
from batchprefill.io.openai_lines import (
    ERROR_CODE,
    ERROR_MESSAGE,
    ID,
    LINE,
    MESSAGES,
    MODEL,
    PROMPT,
    SAMPLING_COLUMNS,
    SCHEMA,
    TASK,
    URL_TASKS,
    parse_line,
)
from batchprefill.io.unique_ids import ROW, IdBuckets

ID_PASS_LINES = 8192  # lines parsed at a time while their custom_ids are checked
# Buckets far below the id check's defaults, spilled early: the reader alone stays under 190 MB on a million lines
ID_BUCKET_BYTES, ID_PENDING_BYTES = 1 << 20, 2 << 20


class OpenAIBatchFormat(InputFormat):
    name, label, suffix = "openai_batch", "JSONL", ".jsonl"
    fixed_columns = True
    row_tasks = tuple(dict.fromkeys(URL_TASKS.values()))  # a line's url says what it runs

    def default_input(self) -> str:
        raise JobError("data.format=openai_batch needs data.input: a JSONL file of OpenAI Batch API requests")

    def open(self, files: list[Path]) -> OpenAIBatchFile:
        return OpenAIBatchFile(files)

    def columns(self, given: Columns) -> Columns:
        """The reader's own columns, custom_id the id; a namespace and a per-row schema column may still be named. A
        body's `model` that names one of model.adapters runs with it; any other name runs the base model."""
        return Columns(prompt=PROMPT, id=ID, system=None, namespace=given.namespace, messages=MESSAGES,
                       read_error=ERROR_MESSAGE, schema=given.schema, row_task=TASK,
                       sampling=tuple(field.name for field in SAMPLING_COLUMNS), adapter=MODEL,
                       unknown_adapter_is_base=True)

    def finish_outputs(self, out_dir: Path, model: str, token_text: Callable[[int], str]) -> None:
        # here, not at the top: pyarrow.parquet and pyarrow.compute would add 16 MB of RSS to every reader
        from batchprefill.io.openai_results import write_results_jsonl

        write_results_jsonl(out_dir / "results", out_dir / "results.jsonl", model, token_text)


class OpenAIBatchFile:
    """Request lines as an input dataset: a fixed schema, a row count, and record batches read one batch of lines
    at a time."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.schema = SCHEMA
        self.repeated: np.ndarray | None = None  # positions (among request lines, from 0) of repeated custom_ids

    def count_rows(self) -> int:
        count = 0
        for file in self.files:
            with open(file, "rb") as handle:
                count += sum(1 for line in handle if line.strip())
        return count

    def to_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        repeated = self._repeated_positions()
        position = 0
        for lines in self._lines(batch_size):
            rows = [parse_line(number, line) for number, line in lines]
            first, last = np.searchsorted(repeated, [position, position + len(rows)])
            for row in (rows[index] for index in repeated[first:last] - position):
                row.update({ERROR_CODE: "duplicate_custom_id",
                            ERROR_MESSAGE: f"custom_id {row[ID]!r} is used by an earlier line",
                            ID: f"#line-{row[LINE]}"})
            position += len(rows)
            batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
            del rows  # not held while the batch is read: 8,192 rows as Python objects are 5 MB
            yield batch.select(columns) if columns is not None else batch

    def head_share(self, rows: int) -> float | None:
        return None

    def _lines(self, count: int) -> Iterator[list[tuple[int, bytes]]]:
        """The request lines in lists of `count`, each with its number in the files (blank lines are counted)."""
        number = 0
        pending: list[tuple[int, bytes]] = []
        for file in self.files:
            with open(file, "rb") as handle:
                for line in handle:
                    number += 1
                    if line.strip():
                        pending.append((number, line))
                    if len(pending) == count:
                        yield pending
                        pending = []
        if pending:
            yield pending

    def _repeated_positions(self) -> np.ndarray:
        """Every line whose custom_id (or `#line-<n>` stand-in) an earlier line has, found once per file set."""
        if self.repeated is None:
            with tempfile.TemporaryDirectory(prefix="batchprefill-custom-ids-") as scratch:
                buckets = IdBuckets(Path(scratch) / "ids", self.count_rows(), "custom_ids", ID_BUCKET_BYTES,
                                    ID_PENDING_BYTES)
                try:
                    for lines in self._lines(ID_PASS_LINES):
                        buckets.add(pa.array([parse_line(number, line)[ID] for number, line in lines], pa.string()))
                    found = [repeats[ROW].to_numpy() for repeats in buckets.repeats()]
                finally:
                    buckets.close()
            self.repeated = np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
        return self.repeated
