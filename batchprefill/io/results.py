"""Results out, in Parquet parts that appear whole (written aside, then renamed), and their ids read back in for a
resume or a merge."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchprefill.io.atomic import STAGING_SUFFIX, write_atomic
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
DAMAGED_DIR = ".damaged"  # under results/: parts that could not be read, set aside, never counted
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


def clear_leftovers(results_dir: Path, shard_index: int, stats_folder: Path) -> list[str]:
    """What a crashed writer of this shard left in `results_dir` and its `stats_folder`, cleared before the shard's
    run counts its rows (the caller holds the shard's lock, so no live writer owns any of it): staging files are
    removed, and parts that cannot be read (cut short by a version that wrote in place) are moved to
    `results/.damaged/`, so their rows run again and nothing a person may want to look at is deleted. Returns one
    phrase per kind of leftover."""
    prefix = f"part-{shard_index:04d}-"
    staging = [*results_dir.glob(f".{prefix}*{STAGING_SUFFIX}"), *stats_folder.glob(f".*{STAGING_SUFFIX}")]
    for file in staging:
        file.unlink(missing_ok=True)
    damaged = []
    for part in sorted(results_dir.glob(f"{prefix}*.parquet")):
        try:
            pq.read_metadata(part)
        except pa.ArrowInvalid:  # no footer: never committed whole
            (results_dir / DAMAGED_DIR).mkdir(exist_ok=True)
            part.rename(results_dir / DAMAGED_DIR / part.name)
            damaged.append(part.name)
    done = [f"removed {len(staging)} staging file(s) of a killed writer"] if staging else []
    if damaged:
        done.append(f"set aside {len(damaged)} part(s) that cannot be read ({', '.join(damaged)}) in "
                    f"{results_dir / DAMAGED_DIR}; their rows run again")
    return done


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
    """Buffers finished rows and commits them as Parquet parts of bounded size or age. `guard` runs before each
    commit and raises if this run may no longer write (its lock on the shard was lost)."""

    def __init__(self, results_dir: Path, shard_index: int, every_rows: int, every_seconds: float,
                 fields: list[pa.Field] = OUTPUT_FIELDS, guard: Callable[[], None] = lambda: None):
        self.results_dir = results_dir
        self.guard = guard
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
        self.guard()
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


