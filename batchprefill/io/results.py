"""Results and statistics out: Parquet files that appear whole (written aside, then renamed)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from batchprefill.io.atomic import write_atomic
from batchprefill.io.columns import INTERNAL
from batchprefill.io.own_files import read_parquet

if TYPE_CHECKING:  # matplotlib loads only where a figure is drawn
    pass

OUTPUT_FIELDS = [
    pa.field("output_text", pa.string()),
    pa.field("output_token_ids", pa.list_(pa.int32())),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
]
SAMPLE_INDEX = pa.field("sample_index", pa.int32())  # with sampling.n > 1: which of a row's samples
LOGPROB_FIELDS = [  # with sampling.logprobs
    pa.field("output_logprobs", pa.list_(pa.float64())),
    pa.field("output_top_logprobs", pa.list_(pa.list_(pa.struct([("token_id", pa.int32()),
                                                                 ("logprob", pa.float64())])))),
]
SCORE_FIELDS = [  # task=score, in place of the output_* columns
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("choice_logprobs", pa.list_(pa.float64())),
    pa.field("choice_num_tokens", pa.list_(pa.int32())),
    pa.field("choice_is_greedy", pa.list_(pa.bool_())),
    pa.field("best_choice", pa.int32()),
]


def result_fields(task: str, samples: bool, logprobs: bool) -> list[pa.Field]:
    """The columns a job adds to its input columns (INTERFACE.md, "What a run writes")."""
    if task == "score":
        return SCORE_FIELDS
    return [SAMPLE_INDEX] * samples + OUTPUT_FIELDS + LOGPROB_FIELDS * logprobs


def done_ids(results_dir: Path, id_column: str, samples: bool = False) -> set:
    """Ids already committed by earlier runs into this output folder; with `samples`, (id, sample_index) pairs."""
    ids: set = set()
    columns = [id_column, SAMPLE_INDEX.name] if samples else [id_column]
    for part in sorted(results_dir.glob("part-*.parquet")):
        remedy = "delete the part and rerun: its rows run again"
        table = read_parquet(part, columns, remedy)
        keys = table[id_column].to_pylist()
        ids.update(zip(keys, table[SAMPLE_INDEX.name].to_pylist()) if samples else keys)
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
    columns: dict[str, object] = field(default_factory=dict)  # the job's other result columns (result_fields)

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


