"""`batchprefill-run`'s job: prepare the input, run this shard's partitions through the engine, write it all out."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator

import pyarrow.parquet as pq
from tqdm import tqdm

from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.intmath import cdiv
from batchprefill.io.atomic import write_records
from batchprefill.io.columns import ROW
from batchprefill.io.formats import input_format
from batchprefill.io.results import Outcome, ResultWriter, done_ids
from batchprefill.model.config import ModelConfig
from batchprefill.model.loader import dtype_choice, resolve_device
from batchprefill.model.quantization import job_quantization
from batchprefill.pipeline.build_engine import JobModel, build_engine, engine_on, structured_outputs
from batchprefill.pipeline.job_record import check_same_job
from batchprefill.pipeline.manifest import PARTITION_SCHEMA, partition_path, partition_records, read_partition
from batchprefill.pipeline.order import assign_shards
from batchprefill.pipeline.prepare import Prepared, prepare_job
from batchprefill.pipeline.request_params import max_output_tokens, may_be_constrained
from batchprefill.pipeline.requests import PartitionRun, load_partition
from batchprefill.pipeline.shard_lock import ShardLock, sole_writer
from batchprefill.report.run_figure import write_run_figure
from batchprefill.report.startup import StartupClock
from batchprefill.report.stats import JobTotals, job_row, stats_dir, write_stats
from batchprefill.report.summary import print_run_summary
from batchprefill.settings import JobSettings
from batchprefill.tasks import get_task
from batchprefill.tasks.base import Task

SIGTERM_EXIT_STATUS = 143


class Interrupted(Exception):
    """SIGTERM arrived (Slurm preemption or time limit): commit what finished and stop."""


def run_job(job: JobSettings, model: JobModel | None = None) -> dict:
    """Run the job these settings describe, as the one live writer of its shard; returns the job statistics row.
    With `model` (a batchprefill.Runner's, loaded for settings with the same model.* and engine.* keys) it loads
    nothing and builds its engine on that."""
    with sole_writer(job.output.dir, job.data.sharding, job.output.lease_seconds) as lock:
        return _run_job(job, lock, model)


def _run_job(job: JobSettings, lock: ShardLock, model: JobModel | None) -> dict:
    clock = StartupClock()
    task = get_task(job.task)
    prepared = prepare_job(job, model.files if model else None)
    out, sharding = job.output.dir, job.data.sharding
    results_dir = out / "results"
    skip = _committed_ids(job, prepared, results_dir)
    mine = _shard_partitions(job, prepared)
    output_tokens, constrained = _shard_demand(job, prepared, mine)
    structured = structured_outputs(job, prepared) if constrained else None  # before the model: a bad schema fails fast
    tokens_needed = _tokens_needed(job, task, prepared, mine, output_tokens)
    rows = sum(prepared.manifest.partition_rows[p] for p in mine) * job.sampling.n
    typical = cdiv(tokens_needed, rows) if rows else None  # a request's mean KV need: what engine.*=auto fits
    writer = ResultWriter(results_dir, sharding.shard_index, job.output.commit_every_rows,
                          job.output.commit_every_seconds,
                          _result_fields(job, task), lock.check)
    totals = JobTotals(adapter_names=[None, *sorted(job.model.adapters)])
    # The bar before the engine: it says what start-up does (loading, on a GPU compiling kernels and capturing graphs).
    bar = tqdm(total=rows, desc=job.task, unit="req", disable=not job.output.progress)
    clock.building(bar.set_description)
    try:
        engine = (engine_on(job, model, prepared.model.tokenizer, tokens_needed, structured, typical, clock) if model
                  else build_engine(job, prepared, tokens_needed, structured, typical, clock))
    except BaseException:
        bar.close()
        raise
    clock.engine_ready()
    bar.set_description(job.task)
    stop, previous_handler = _trap_sigterm()
    try:
        _drive(engine, _requests(task, job, prepared, mine, skip, writer, totals, bar, stop), task, writer, totals,
               bar, stop)
    except Interrupted:
        bar.close()
        print(f"batchprefill: stopped by SIGTERM after committing {writer.committed_rows} rows; "
              "rerun with the same output.dir to resume", file=sys.stderr)
        sys.exit(SIGTERM_EXIT_STATUS)
    finally:  # before any error line: a bar left open redraws itself at exit, after it
        bar.close()
        engine.close()  # the pool goes back now: a Runner's next job on this device sizes its own from free memory
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    stats = job_row(totals, engine.counters, engine.config, time.perf_counter() - clock.began) | clock.seconds()
    stats_folder = stats_dir(out, sharding)
    write_stats(stats_folder, totals, engine.counters.steps, stats)
    if sharding.num_shards == 1:  # shards: the merge finishes the outputs
        input_format(job.data.format).finish_outputs(out, job.model.name, prepared.model.tokenizer.decode_one)
    figure = write_run_figure(stats_folder, "batchprefill") if job.output.plot else None
    quantization = job_quantization(prepared.model.config.quantization, job.model.quantization)
    precision = dtype_choice(job.model.dtype, resolve_device(job.engine.device), quantization)
    print_run_summary(stats, out, figure, precision, kv_pool_line(engine, prepared.model.config),
                      engine.config.sizes_summary, job.output.temporary)
    return stats


def kv_pool_line(engine: Engine, config: ModelConfig) -> str:
    """"a KV pool of 8,192 tokens in float8_e4m3fn, 11,520 bytes a token": what engine.kv_cache_dtype bought."""
    tokens = engine.config.num_blocks * engine.config.settings.block_size  # the pool itself is given back by now
    dtype = engine.kv_dtype
    per_token = config.kv_bytes_per_token(dtype.itemsize)
    return f"a KV pool of {tokens:,} tokens in {str(dtype).removeprefix('torch.')}, {per_token:,} bytes a token"


def _committed_ids(job: JobSettings, prepared: Prepared, results_dir) -> set:
    """Ids an earlier run of this same job (job_record.py) into this output folder already committed, which this
    run skips; with sampling.n > 1, the (id, sample_index) pairs committed (a row runs again unless all its samples
    are in)."""
    if job.output.resume:
        check_same_job(job, prepared, results_dir)
        return done_ids(results_dir, job.data.columns.id, job.sampling.n > 1)
    if any(results_dir.glob("part-*.parquet")):
        raise JobError(f"{results_dir} already holds results and output.resume=false: choose another output.dir")
    check_same_job(job, prepared, results_dir)
    return set()


def _shard_partitions(job: JobSettings, prepared: Prepared) -> list[int]:
    """This shard's non-empty partitions; the whole job's assignment goes to stats/partitions.parquet."""
    manifest = prepared.manifest
    shards = assign_shards(manifest.partition_tokens, job.data.sharding.num_shards)
    write_records(partition_records(manifest, shards), job.output.dir / "stats" / "partitions.parquet",
                  PARTITION_SCHEMA)
    return [p for p in shards[job.data.sharding.shard_index] if manifest.partition_rows[p]]


def _shard_demand(job: JobSettings, prepared: Prepared, partitions: list[int]) -> tuple[int, bool]:
    """The most output tokens this shard's rows may ask for, and whether any of them can be constrained.

    Rows set their own max_tokens and constraints only through per-request columns; those alone are read back."""
    columns, default = job.data.columns, job.sampling
    rows = sum(prepared.manifest.partition_rows[p] for p in partitions)
    wanted = [*columns.sampling, *([columns.schema] if columns.schema else [])]
    if not wanted:
        return rows * default.max_tokens, default.constraint is not None
    output_tokens, constrained = 0, default.constraint is not None
    for part in partitions:
        names = pq.read_schema(partition_path(prepared.partitions_dir, part)).names
        table = read_partition(prepared.partitions_dir, part, [name for name in wanted if name in names])
        output_tokens += max_output_tokens(table, default)
        constrained = constrained or may_be_constrained(table, columns)
    return output_tokens, constrained


def _tokens_needed(job: JobSettings, task: Task, prepared: Prepared, partitions: list[int], output_tokens: int) -> int:
    """KV slots that would hold every prompt and output of this shard at once: a pool never needs more."""
    prompt_tokens = sum(prepared.manifest.partition_tokens[p] for p in partitions)
    return task.kv_tokens(prompt_tokens, output_tokens, job.sampling.n)


def _trap_sigterm() -> tuple[list[bool], object]:
    """A flag SIGTERM sets, and the handler it replaced, which the job puts back when it ends: a Python caller's
    process (a notebook's kernel) must not go on ignoring SIGTERM. Only the main thread may trap signals, so a job
    run from another thread (a pipeline's worker) is stopped by SIGTERM as its process would be."""
    flag = [False]
    if threading.current_thread() is not threading.main_thread():
        return flag, None

    def handler(signum, frame):
        flag[0] = True

    return flag, signal.signal(signal.SIGTERM, handler)


def _requests(task: Task, job: JobSettings, prepared: Prepared, partitions: list[int], skip: set,
              writer: ResultWriter, totals: JobTotals, bar: tqdm,
              stop: list[bool]) -> Iterator[tuple[PartitionRun, Request]]:
    """Requests of every partition in turn, each with its partition: the next partition starts while the last one
    drains. Rows that never reach the engine are written here as error rows."""
    for part in partitions:
        run = load_partition(job, task, prepared, part, skip)
        totals.ideal_cached_tokens += run.ideal_cached_tokens
        row_numbers = run.table[ROW]
        for index, message in run.errors:
            for sample in range(job.sampling.n):
                if (row_numbers[index].as_py(), sample) not in run.written:
                    writer.add(run.table, index, Outcome("", [], 0, 0, "error", message, _sample_column(job, sample)))
                    totals.add_error_row()
                bar.update(1)
        for request in run.requests:
            if stop[0]:
                raise Interrupted
            yield run, request


def _drive(engine: Engine, requests: Iterator[tuple[PartitionRun, Request]], task: Task, writer: ResultWriter,
           totals: JobTotals, bar: tqdm, stop: list[bool]) -> None:
    """The engine loop: feed requests, write each finished one, commit at the end or on SIGTERM."""
    owners: dict[int, list] = {}  # request id -> [the partition it came from, its result rows still to come]

    def feed() -> Iterator[Request]:
        for run, request in requests:
            owners[request.request_id] = [run, request.sampling.n]
            yield request

    try:
        for request in engine.generate(feed()):
            owner = owners[request.request_id]
            owner[1] -= 1
            if not owner[1]:
                del owners[request.request_id]
            _record(owner[0], request, task, writer, totals)
            bar.update(1)
            if totals.prompt_tokens:
                bar.set_postfix(hit=f"{totals.cached_tokens / totals.prompt_tokens:.1%}", refresh=False)
            if stop[0]:
                raise Interrupted
    finally:
        writer.commit()


def _record(run: PartitionRun, request: Request, task: Task, writer: ResultWriter, totals: JobTotals) -> None:
    """Write a finished request's row; when its partition is done, add the partition's group statistics."""
    index = run.position[request.request_id]
    run.unfinished -= 1
    if (request.request_id, request.sample_index) in run.written:
        return  # an earlier run committed this sample
    writer.add(run.table, index, Outcome(
        request.output_text, request.output_token_ids, request.num_row_prompt_tokens,
        request.num_cached_tokens or 0, request.finish_reason, request.error,
        run.tasks.get(request.request_id, task).result_columns(request)))
    totals.add_finished(request)
    if run.unfinished == 0:
        totals.add_groups(run.part, run.groups, run.requests)


def _result_fields(job: JobSettings, task: Task) -> list:
    """The job's task's result columns, then those of the tasks its rows may name themselves (an OpenAI batch file's
    embeddings lines beside its chat lines), each column once."""
    fields = {}
    for each in (task, *map(get_task, input_format(job.data.format).row_tasks)):
        for field in each.result_fields(job.sampling.n > 1, _may_ask_logprobs(job)):
            fields.setdefault(field.name, field)
    return list(fields.values())


def _may_ask_logprobs(job: JobSettings) -> bool:
    """Whether rows may carry logprobs: the job asks for them, or the format gives each row a `logprobs` column
    of its own (an OpenAI batch line's; the columns are null on the lines that do not ask)."""
    return job.sampling.logprobs is not None or "logprobs" in job.data.columns.sampling


def _sample_column(job: JobSettings, sample: int) -> dict:
    return {"sample_index": sample} if job.sampling.n > 1 else {}

