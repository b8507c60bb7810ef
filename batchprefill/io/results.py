"""Results out, in Parquet parts that appear whole (written aside, then renamed), and their ids read back in for a
resume or a merge."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from batchprefill.io.atomic import write_atomic
from batchprefill.io.columns import INTERNAL
from batchprefill.io.own_files import read_parquet

OUTPUT_FIELDS = [
    pa.field("output_text", pa.string()),
    pa.field("output_token_ids", pa.list_(pa.int32())),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
]
RESUME_REMEDY = "delete the part and rerun: its rows run again"
SAMPLE_INDEX = pa.field("sample_index", pa.int32())  # with sampling.n > 1: which of a row's samples
LOGPROB_FIELDS = [  # with sampling.logprobs
    pa.field("output_logprobs", pa.list_(pa.float64())),
    pa.field("output_top_logprobs", pa.list_(pa.list_(pa.struct([("token_id", pa.int32()),
                                                                 ("logprob", pa.float64())])))),
]


def committed_parts(results_dir: Path, id_column: str, samples: bool,
                    remedy: Callable[[str], str]) -> Iterator[tuple[str, list]]:
    """Each committed part's name and ids, (id, sample_index) pairs with `samples`, one part at a time; staging
    files (`.part-*.tmp`) of a killed writer are not parts. A damaged part stops the job with `remedy(its name)`."""
    columns = [id_column, SAMPLE_INDEX.name] if samples else [id_column]
    for part in sorted(results_dir.glob("part-*.parquet")):
        table = read_parquet(part, columns, remedy(part.name))
        ids = table[id_column].to_pylist()
        yield part.name, list(zip(ids, table[SAMPLE_INDEX.name].to_pylist())) if samples else ids


def done_ids(results_dir: Path, id_column: str, samples: bool = False) -> set:
    """Ids already committed by earlier runs into this output folder; with `samples`, (id, sample_index) pairs."""
    ids: set = set()
    for _, part_ids in committed_parts(results_dir, id_column, samples, lambda _: RESUME_REMEDY):
        ids.update(part_ids)
    return ids


@dataclass
class Outcome:
    """What one input row produced."""

    output_text: str
    output_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None
    error: str | None
    columns: dict[str, object] = field(default_factory=dict)  # the task's other result columns

    def value(self, name: str) -> object:
        return getattr(self, name) if name in Outcome.__dataclass_fields__ else self.columns.get(name)


class ResultWriter:
    """Buffers finished rows and commits them as Parquet parts of bounded size or age."""

    def __init__(self, results_dir: Path, shard_index: int, every_rows: int, every_seconds: float,
                 fields: list[pa.Field] = OUTPUT_FIELDS):
        self.results_dir = results_dir
        self.fields = fields
        self.prefix = f"part-{shard_index:04d}-{time.time_ns():x}"
        self.every_rows = every_rows
        self.every_seconds = every_seconds
        self.pending: list[tuple[pa.Table, int, Outcome]] = []
        self.parts = 0
        self.committed_rows = 0
        self.last_commit = time.monotonic()

    def add(self, rows: pa.Table, index: int, outcome: Outcome) -> None:
        self.pending.append((rows, index, outcome))
        if len(self.pending) >= self.every_rows or time.monotonic() - self.last_commit >= self.every_seconds:
            self.commit()

    def commit(self) -> None:
        self.last_commit = time.monotonic()
        if not self.pending:
            return
        pieces = []
        by_table: dict[int, tuple[pa.Table, list[int], list[Outcome]]] = {}
        for table, index, outcome in self.pending:
            entry = by_table.setdefault(id(table), (table, [], []))
            entry[1].append(index)
            entry[2].append(outcome)
        for table, indices, outcomes in by_table.values():
            inputs = table.take(indices).drop_columns([c for c in INTERNAL if c in table.column_names])
            for column in self.fields:
                values = [o.value(column.name) for o in outcomes]
                inputs = inputs.append_column(column, pa.array(values, type=column.type))
            pieces.append(inputs)
        write_atomic(pa.concat_tables(pieces), self.results_dir / f"{self.prefix}-{self.parts:05d}.parquet")
        self.parts += 1
        self.committed_rows += len(self.pending)
        self.pending = []


