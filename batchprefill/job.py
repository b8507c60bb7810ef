"""`batchprefill-run`'s job: prepare the input, run this shard's partitions through the engine, write it all out."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from batchprefill.dataset import read_parquet
from batchprefill.engine.config import EngineConfig
from batchprefill.engine.constraint import GrammarError
from batchprefill.engine.engine import Engine
from batchprefill.engine.grammar import Grammars
from batchprefill.engine.kv_cache import pool_blocks
from batchprefill.engine.request import Request, SamplingParams
from batchprefill.engine.structured import StructuredStep
from batchprefill.errors import JobError
from batchprefill.malloc import keep_freed_memory
from batchprefill.model.loader import load_model, make_ops, resolve_device, resolve_dtype
from batchprefill.openai_results import write_results_jsonl
from batchprefill.order import Group, assign_shards, groups, reusable_tokens, run_order, shared_with_previous
from batchprefill.preparation import Prepared, prepare_job
from batchprefill.prepare import ERROR, NAMESPACE, PARTITION_SCHEMA, ROW, TOKENS, partition_path, partition_records
from batchprefill.request_params import max_output_tokens, may_be_constrained, partition_sampling
from batchprefill.run_figure import write_run_figure
from batchprefill.settings import DataSettings, JobSettings
from batchprefill.stats import JobTotals, job_row, print_summary, stats_dir, write_stats
from batchprefill.writer import Outcome, ResultWriter, done_ids, write_records

SIGTERM_EXIT_STATUS = 143
PARTITION_REMEDY = "delete output.dir/partitions and rerun: the job prepares them again and resumes"


class Interrupted(Exception):
    """SIGTERM arrived (Slurm preemption or time limit): commit what finished and stop."""


@dataclass
class PartitionRun:
    """One partition in flight: its rows (kept until its last request is written) and its requests."""

    part: int
    table: pa.Table
    errors: list[tuple[int, str]]  # (row of table, message) of rows that never reach the engine
    requests: list[Request]  # in run order
    groups: list[Group]
    position: dict[int, int]  # request id -> row of table
    unfinished: int
    ideal_cached_tokens: int  # what an ideal cache serves in this run order (the plan's arithmetic)


def run_job(job: JobSettings) -> dict:
    """Run the job these settings describe; returns the job statistics row."""
    started = time.perf_counter()
    prepared = prepare_job(job)
    out, sharding = job.output.dir, job.data.sharding
    results_dir = out / "results"
    skip = _committed_ids(job, results_dir)
    mine = _shard_partitions(job, prepared)
    output_tokens, constrained = _shard_demand(job, prepared, mine)
    structured = structured_step(job, prepared) if constrained else None  # before the model: a bad schema fails fast
    engine = build_engine(job, prepared, _tokens_needed(prepared, mine, output_tokens), structured)
    writer = ResultWriter(results_dir, sharding.shard_index, job.output.commit_every_rows,
                          job.output.commit_every_seconds)
    totals = JobTotals()
    bar = tqdm(total=sum(prepared.manifest.partition_rows[p] for p in mine), desc="generate", unit="req",
               disable=not job.output.progress)
    stop = _trap_sigterm()
    try:
        _drive(engine, _requests(job, prepared, mine, skip, writer, totals, bar, stop), writer, totals, bar, stop)
    except Interrupted:
        bar.close()
        print(f"batchprefill: stopped by SIGTERM after committing {writer.committed_rows} rows; "
              "rerun with the same output.dir to resume", file=sys.stderr)
        sys.exit(SIGTERM_EXIT_STATUS)
    bar.close()
    stats = job_row(totals, engine, time.perf_counter() - started)
    write_stats(stats_dir(out, sharding), totals, engine, stats)
    if job.data.format == "openai_batch" and sharding.num_shards == 1:  # shards: the merge writes it
        write_results_jsonl(results_dir, out / "results.jsonl", job.model.name, prepared.tokenizer.decode_one)
    figure = write_run_figure(stats_dir(out, sharding), "batchprefill") if job.output.plot else None
    print_summary(stats, out, figure)
    return stats


def _committed_ids(job: JobSettings, results_dir) -> set:
    """Ids an earlier run into this output folder already committed, which this run skips."""
    if job.output.resume:
        return done_ids(results_dir, job.data.columns.id)
    if any(results_dir.glob("part-*.parquet")):
        raise JobError(f"{results_dir} already holds results and output.resume=false: choose another output.dir")
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
        path = partition_path(prepared.partitions_dir, part)
        table = read_parquet(path, [name for name in wanted if name in pq.read_schema(path).names], PARTITION_REMEDY)
        output_tokens += max_output_tokens(table, default)
        constrained = constrained or may_be_constrained(table, columns)
    return output_tokens, constrained


def _tokens_needed(prepared: Prepared, partitions: list[int], output_tokens: int) -> int:
    """KV slots that would hold every prompt and output of this shard at once: a pool never needs more."""
    return sum(prepared.manifest.partition_tokens[p] for p in partitions) + output_tokens


def structured_step(job: JobSettings, prepared: Prepared) -> StructuredStep:
    """The grammar machinery, built only for a job whose rows can be constrained; the job-wide constraint is
    compiled here, before the model loads, so a schema that cannot compile fails the job in seconds."""
    config = prepared.model_config
    grammars = Grammars(prepared.tokenizer, config.vocab_size, config.eos_token_ids)
    constraint = job.sampling.constraint
    if constraint is not None:
        try:
            grammars.compile(constraint)
        except GrammarError as error:
            raise JobError(f"sampling.{constraint.kind}: {error}; fix the constraint") from None
    return StructuredStep(grammars, job.engine.max_num_seqs)


def build_engine(job: JobSettings, prepared: Prepared, tokens_needed: int,
                 structured: StructuredStep | None = None) -> Engine:
    """Load the model on the chosen device and backend, size the KV pool, and build the engine around them."""
    settings = job.engine
    device = resolve_device(settings.device)
    keep_freed_memory()
    if device.type == "cpu" and settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    dtype = resolve_dtype(job.model.dtype, device)
    kv_dtype = dtype if settings.kv_cache_dtype == "auto" else resolve_dtype(settings.kv_cache_dtype, device)
    ops = make_ops(settings.attention_backend, device)
    model_config = prepared.model_config
    loaded = load_model(prepared.folder, dtype, device, ops, model_config, prepared.identity)
    graphs = settings.cuda_graphs and device.type == "cuda" and ops.graph_safe_decode
    num_blocks = pool_blocks(model_config, kv_dtype, device, settings.block_size, settings.max_num_seqs,
                             settings.kv_cache_tokens, tokens_needed)
    config = EngineConfig(
        block_size=settings.block_size, max_batched_tokens=settings.max_batched_tokens,
        max_num_seqs=settings.max_num_seqs, num_blocks=num_blocks, prefix_caching=settings.prefix_caching,
        cache_namespace=settings.cache_namespace, reserve_output_blocks=settings.reserve_output_blocks,
        padded_decode="graphs" if graphs else "off",
    )
    scope = (loaded.identity, str(dtype), str(kv_dtype), model_config.rope_theta, repr(model_config.rope_scaling),
             model_config.layer_windows, settings.block_size, job.model.adapter)
    return Engine(loaded.model, config, prepared.tokenizer.decode, scope, kv_dtype, device, structured)


def _trap_sigterm() -> list[bool]:
    flag = [False]

    def handler(signum, frame):
        flag[0] = True

    signal.signal(signal.SIGTERM, handler)
    return flag


def _requests(job: JobSettings, prepared: Prepared, partitions: list[int], skip: set, writer: ResultWriter,
              totals: JobTotals, bar: tqdm, stop: list[bool]) -> Iterator[tuple[PartitionRun, Request]]:
    """Requests of every partition in turn, each with its partition: the next partition starts while the last one
    drains. Rows that never reach the engine are written here as error rows."""
    for part in partitions:
        run = load_partition(job.data, job.engine.block_size, job.sampling, prepared, part, skip)
        totals.ideal_cached_tokens += run.ideal_cached_tokens
        for index, message in run.errors:
            writer.add(run.table, index, Outcome("", [], 0, 0, "error", message))
            totals.add_error_row()
            bar.update(1)
        for request in run.requests:
            if stop[0]:
                raise Interrupted
            yield run, request


def _drive(engine: Engine, requests: Iterator[tuple[PartitionRun, Request]], writer: ResultWriter,
           totals: JobTotals, bar: tqdm, stop: list[bool]) -> None:
    """The engine loop: feed requests, write each finished one, commit at the end or on SIGTERM."""
    owners: dict[int, PartitionRun] = {}  # request id -> the partition it came from

    def feed() -> Iterator[Request]:
        for run, request in requests:
            owners[request.request_id] = run
            yield request

    try:
        for request in engine.generate(feed()):
            _record(owners.pop(request.request_id), request, writer, totals)
            bar.update(1)
            if totals.prompt_tokens:
                bar.set_postfix(hit=f"{totals.cached_tokens / totals.prompt_tokens:.1%}", refresh=False)
            if stop[0]:
                raise Interrupted
    finally:
        writer.commit()


def load_partition(data: DataSettings, block_size: int, params: SamplingParams, prepared: Prepared, part: int,
                   skip: set) -> PartitionRun:
    """Read one partition, drop rows already done, order the rest and turn them into requests."""
    table = read_parquet(partition_path(prepared.partitions_dir, part), None, PARTITION_REMEDY)
    if skip:
        table = table.filter(pa.array([i not in skip for i in table[data.columns.id].to_pylist()]))
    sampling = partition_sampling(table, data.columns, params, prepared.model_config.max_positions)
    table = table.set_column(table.schema.get_field_index(ERROR), ERROR, pa.array(sampling.errors, pa.string()))
    order = run_order(table[TOKENS], table[NAMESPACE], table[ROW], table[ERROR], data.order)
    token_ids, namespaces = table[TOKENS].take(order), table[NAMESPACE].take(order)
    rows = table[ROW].take(order).to_pylist()
    settings = [sampling.settings[i] for i in sampling.index[order].tolist()]
    requests = [Request(row, ids, row_params, namespace) for row, ids, row_params, namespace
                in zip(rows, token_ids.to_pylist(), settings, namespaces.to_pylist())]
    link_prefix_donors(requests, shared_with_previous(token_ids, namespaces, block_size))
    errors = [(i, message) for i, message in enumerate(sampling.errors) if message is not None]
    return PartitionRun(part, table, errors, requests, groups(token_ids, namespaces, block_size),
                        dict(zip(rows, order.tolist())), len(requests),
                        sum(reusable_tokens(token_ids, namespaces, block_size)))


def link_prefix_donors(requests: list[Request], shared_blocks: np.ndarray) -> None:
    """Point each request at the one before it in run order when they share leading full blocks (the order
    stage's count), so the scheduler copies those block keys instead of hashing the same tokens again."""
    for previous, request, shared in zip(requests, requests[1:], shared_blocks[1:].tolist()):
        if shared:
            request.prefix_donor, request.donor_blocks = previous, shared


def _record(run: PartitionRun, request: Request, writer: ResultWriter, totals: JobTotals) -> None:
    """Write a finished request's row; when its partition is done, add the partition's group statistics."""
    writer.add(run.table, run.position[request.request_id], Outcome(
        request.output_text, request.output_token_ids, request.num_prompt_tokens, request.num_cached_tokens or 0,
        request.finish_reason, request.error))
    totals.add_finished(request)
    run.unfinished -= 1
    if run.unfinished == 0:
        totals.add_groups(run.part, run.groups, run.requests)
