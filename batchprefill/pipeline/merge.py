"""`batchprefill-merge`: the step after a Slurm array. Checks that every input row has exactly one result, then
combines the shards' statistics into the single-job files under `stats/`.

Completeness is judged against the partitions the job prepared (`output.dir/partitions`): they hold every input
row with its id, so the merge needs neither the input nor the model. Exit status: 0 when complete; 1, with one
line on stderr naming the missing or duplicated ids and the shards to rerun, when not; 2 for a config fault.
With `sampling.n` > 1 a result is one (id, sample_index) pair, and every row needs each of its n samples once.

How shard statistics combine into `stats/job.parquet`:
- counts (requests, errors, tokens, evictions, preemptions) are summed;
- `wall_seconds` is the slowest shard's: array tasks run side by side, so that is the array's elapsed time, and
  the rates (`prefill_tokens_per_second`, `output_tokens_per_second`) computed from the sums over it are the
  job's aggregate throughput; `shard_seconds` (added) sums the shards' times, the device time spent;
- counts include `ideal_cached_tokens`, what an ideal cache would serve in each shard's run order;
- `prepare_seconds`, `load_seconds` and `warm_up_seconds` (report.startup) are the slowest shard's, like
  `wall_seconds`;
- peaks (`active_blocks`, `reclaimable_blocks`, `free_blocks`) are the largest any shard reached, and
  `max_batched_tokens` the largest budget;
- `num_shards` (added) says how many shards' statistics were combined.
Each shard's statistics describe its last run: rows that an earlier, interrupted run committed are in the
results but not in its counts. `stats/groups.parquet` concatenates the shards' groups (group ids are unique
across partitions); `stats/steps.parquet` concatenates their steps with a `shard` column. `stats/run.png` is then
drawn from the combined files (`output.plot`), the shards' steps one after another.
"""

from __future__ import annotations

import functools
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchprefill.errors import JobError
from batchprefill.io.atomic import write_atomic, write_records
from batchprefill.io.formats import input_format
from batchprefill.io.own_files import read_parquet
from batchprefill.io.results import committed_parts
from batchprefill.model.loader import resolve_folder
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pipeline.manifest import MANIFEST_NAME, partition_path, read_manifest, read_partition
from batchprefill.pipeline.order import assign_shards
from batchprefill.report.run_figure import write_run_figure
from batchprefill.report.startup import STARTUP_COLUMNS
from batchprefill.report.stats import ADAPTER_SCHEMA
from batchprefill.settings import JobSettings

# The job row's columns combined by their largest value; the rates are recomputed and every other column is a count,
# summed (see the module docstring).
PEAKS = ("active_blocks", "reclaimable_blocks", "free_blocks", "wall_seconds", "max_batched_tokens",
         *STARTUP_COLUMNS)
SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")
PART_NAME = re.compile(r"part-(\d+)-")  # results/part-<shard>-<stamp>-<n>.parquet
SHOWN = 5  # ids named in the one-line report
STATS_REMEDY = "rerun that shard with the same output.dir: a finished shard rewrites its statistics"


class Incomplete(JobError):
    """Results are missing or duplicated: the message is the one line that says which and what to rerun."""

    exit_status = 1


@dataclass
class Inputs:
    """Every input row's id, and the partition each came from (to name the shard that owns it)."""

    ids: list
    partition_of: dict
    partition_tokens: list[int]


def read_inputs(partitions_dir: Path, id_column: str, samples: int = 1) -> Inputs:
    manifest_file = partitions_dir / MANIFEST_NAME
    if not manifest_file.exists():
        raise JobError(f"{partitions_dir} holds no prepared partitions: pass the output.dir that batchprefill-run "
                       "wrote to")
    try:
        manifest = read_manifest(partitions_dir)
    except (OSError, ValueError) as error:
        raise JobError(f"{manifest_file} cannot be read ({error}): rerun the job into a fresh output.dir") from error
    ids: list = []
    partition_of: dict = {}
    for index, rows in enumerate(manifest.partition_rows):
        if rows == 0:
            continue  # an empty partition holds no id
        path = partition_path(partitions_dir, index)
        if not path.exists():
            raise JobError(f"{path} is missing: rerun the job into a fresh output.dir")
        remedy = f"delete {partitions_dir} and rerun the job into the same output.dir: it prepares them again, resumes"
        part_ids = read_partition(partitions_dir, index, [id_column], remedy)[id_column].to_pylist()
        if samples > 1:
            part_ids = [(i, sample) for i in part_ids for sample in range(samples)]
        ids.extend(part_ids)
        partition_of.update(dict.fromkeys(part_ids, index))
    return Inputs(ids, partition_of, manifest.partition_tokens)


def _results_remedy(name: str) -> str:
    match = PART_NAME.match(name)
    shard = f"shard {int(match.group(1))}" if match else "the shard that wrote it"
    return f"delete the part and rerun {shard} with the same output.dir: its rows run again"


def check_complete(inputs: Inputs, parts: dict[str, list], num_shards: int, results_dir: Path) -> int:
    """The number of rows when every input id has exactly one result; raises Incomplete otherwise."""
    want = Counter(inputs.ids)
    have = Counter(i for ids in parts.values() for i in ids)
    missing = [i for i in want if have[i] < want[i]]
    extra = [i for i in have if have[i] > want[i]]
    problems = []
    if missing:
        shards = assign_shards(inputs.partition_tokens, num_shards)
        owner = {p: s for s, owned in enumerate(shards) for p in owned}
        rerun = sorted({owner[inputs.partition_of[i]] for i in missing})
        problems.append(f"{len(missing)} of {len(want)} rows have no result (first: {_first(missing)}); rerun "
                        f"shard(s) {', '.join(map(str, rerun))} of {num_shards} (array task ids, or "
                        "data.shard_index) with the same output.dir and config")
    if extra:
        files = sorted(name for name, ids in parts.items() if set(ids) & set(extra))
        problems.append(f"{len(extra)} ids have more than one result or none in the input (first: "
                        f"{_first(extra)}) in {', '.join(files[:SHOWN])}: remove the surplus parts or rerun "
                        "into a fresh output.dir")
    if problems:
        raise Incomplete(f"{results_dir} is incomplete: " + "; ".join(problems))
    return len(inputs.ids)


def _first(ids: list) -> str:
    return ", ".join(map(str, ids[:SHOWN])) + (", ..." if len(ids) > SHOWN else "")


def shard_stats(stats: Path, num_shards: int | None) -> tuple[int, list[Path]]:
    """The shard count to combine and its shards' stats folders: the config's count, else the newest run's."""
    found: dict[int, list[tuple[int, Path]]] = {}
    for folder in stats.glob("shard-*-of-*"):
        match = SHARD_DIR.fullmatch(folder.name)
        if match and (folder / "job.parquet").exists():
            found.setdefault(int(match.group(2)), []).append((int(match.group(1)), folder))
    if not found:
        return num_shards or 1, []
    if num_shards is None or num_shards not in found:
        num_shards = max(found, key=lambda n: max((f / "job.parquet").stat().st_mtime for _, f in found[n]))
    return num_shards, [folder for _, folder in sorted(found[num_shards])]


def combine_jobs(rows: list[dict]) -> dict:
    """One job row from the shards' rows: see the module docstring for what each column means after merging."""
    job: dict = {}
    for key in rows[0]:
        values = [row[key] for row in rows if row.get(key) is not None]
        job[key] = max(values, default=0) if key in PEAKS else sum(values)
    wall = job["wall_seconds"]
    job["prefill_tokens_per_second"] = job["computed_prompt_tokens"] / wall if wall else 0.0
    job["output_tokens_per_second"] = job["output_tokens"] / wall if wall else 0.0
    job["cache_hit_rate"] = job["cached_tokens"] / job["prompt_tokens"] if job["prompt_tokens"] else 0.0
    job["num_shards"] = len(rows)
    job["shard_seconds"] = sum(row["wall_seconds"] for row in rows)
    return job


def _concat(tables: list[pa.Table]) -> pa.Table:
    """Tables from shards that ran nothing have no columns (an empty list of records): leave them out."""
    shaped = [t for t in tables if t.num_columns] or tables[:1]
    return pa.concat_tables(shaped, promote_options="default")


def merge_stats(stats: Path, folders: list[Path]) -> dict:
    shard_numbers = [int(SHARD_DIR.fullmatch(f.name).group(1)) for f in folders]
    job = combine_jobs([read_parquet(f / "job.parquet", None, STATS_REMEDY).to_pylist()[0] for f in folders])
    groups = _concat([read_parquet(f / "groups.parquet", None, STATS_REMEDY) for f in folders
                      if (f / "groups.parquet").exists()])
    steps = []
    for number, folder in zip(shard_numbers, folders):
        steps_file = folder / "steps.parquet"
        table = read_parquet(steps_file, None, STATS_REMEDY) if steps_file.exists() else pa.table({})
        if table.num_columns:
            table = table.append_column("shard", pa.array([number] * table.num_rows, pa.int32()))
        steps.append(table)
    write_atomic(groups, stats / "groups.parquet")
    write_atomic(_concat(steps), stats / "steps.parquet")
    adapters = [read_parquet(f / "adapters.parquet", None, STATS_REMEDY) for f in folders
                if (f / "adapters.parquet").exists()]
    if adapters:  # with model.adapters: each adapter's counts summed over the shards
        counts = ADAPTER_SCHEMA.names[1:]
        combined = _concat(adapters).group_by("adapter").aggregate([(name, "sum") for name in counts])
        combined = combined.select(["adapter", *(f"{name}_sum" for name in counts)])
        combined = combined.rename_columns(ADAPTER_SCHEMA.names)
        write_atomic(combined.sort_by("adapter"), stats / "adapters.parquet")
    write_records([job], stats / "job.parquet")
    return job


def merge_shards(job: JobSettings) -> str:
    """Check, then combine; returns the summary line."""
    out = job.output.dir
    id_column = job.data.columns.id
    configured = job.data.configured_shards
    inputs = read_inputs(out / "partitions", id_column, job.sampling.n)
    parts = dict(committed_parts(out / "results", id_column, job.sampling.n > 1, _results_remedy))
    num_shards, folders = shard_stats(out / "stats", configured)
    rows = check_complete(inputs, parts, _shards_for_report(configured, num_shards, parts), out / "results")
    input_format(job.data.format).finish_outputs(out, job.model.name, _token_text(job.model.path))
    if not folders:
        return f"batchprefill-merge: all {rows} rows have exactly one result in {out / 'results'}; one shard, " \
               "nothing to combine"
    if len(folders) < num_shards:
        print(f"batchprefill-merge: warning: statistics of only {len(folders)} of {num_shards} shards found in "
              f"{out / 'stats'}; combined those", file=sys.stderr)
    plot = job.output.plot
    job = merge_stats(out / "stats", folders)
    figure = write_run_figure(out / "stats", "batchprefill-merge") if plot else None
    return (f"batchprefill-merge: all {rows} rows have exactly one result in {out / 'results'}; combined "
            f"{len(folders)} shards' statistics ({job['num_requests']} requests, {job['cache_hit_rate']:.1%} "
            f"cache hits, {job['wall_seconds']:.1f} s) into {out / 'stats'}"
            + (f"; the run at a glance: {figure}" if figure else ""))


def _token_text(model_path: str | None) -> Callable[[int], str]:
    """A token id's text from the model's tokenizer, opened at the first call: the merge needs no model unless
    the format's outputs name tokens."""
    tokenizer = functools.cache(lambda: PromptTokenizer(resolve_folder(model_path)))
    return lambda token: tokenizer().decode_one(token)


def _shards_for_report(configured: int | None, from_stats: int, parts: dict[str, list]) -> int:
    """The shard count that owned the rows: configured, else seen in stats, else the part names' shard numbers."""
    if configured:
        return int(configured)
    numbers = [PART_NAME.match(name) for name in parts]
    from_parts = max((int(m.group(1)) + 1 for m in numbers if m), default=1)
    return max(from_stats, from_parts)

