"""`batchprefill-run`'s job: prepare the input, run this shard's partitions through the engine, write it all out."""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from batchprefill.constraint import GrammarError
from batchprefill.engine.config import EngineConfig
from batchprefill.engine.engine import Engine
from batchprefill.engine.grammar import Grammars
from batchprefill.engine.kv_cache import pool_blocks
from batchprefill.engine.request import Request, with_samples
from batchprefill.engine.scoring import score_request
from batchprefill.engine.structured import StructuredOutputs
from batchprefill.errors import JobError
from batchprefill.io.dataset import read_parquet
from batchprefill.io.openai_results import write_results_jsonl
from batchprefill.io.results import Outcome, ResultWriter, done_ids, result_fields, write_records
from batchprefill.malloc import keep_freed_memory
from batchprefill.model.config import ModelConfig
from batchprefill.model.loader import LoadedModel, load_model, make_ops, resolve_device, resolve_dtype
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pipeline.order import Group, assign_shards, groups, reusable_tokens, run_order, shared_with_previous
from batchprefill.pipeline.partitions import (
    CHOICES,
    ERROR,
    NAMESPACE,
    PARTITION_SCHEMA,
    ROW,
    TOKENS,
    partition_path,
    partition_records,
)
from batchprefill.pipeline.prepare import Prepared, prepare_job
from batchprefill.pipeline.request_params import max_output_tokens, may_be_constrained, partition_sampling
from batchprefill.report.run_figure import write_run_figure
from batchprefill.report.stats import JobTotals, job_row, print_summary, stats_dir, write_stats
from batchprefill.sampling_params import SamplingParams
from batchprefill.settings import DataSettings, JobSettings

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
    unfinished: int  # result rows still to write: a row's samples count one each
    ideal_cached_tokens: int  # what an ideal cache serves in this run order (the plan's arithmetic)
    written: set  # with sampling.n > 1: (request id, sample_index) of samples an earlier run committed


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
    engine = build_engine(job, prepared, _tokens_needed(prepared, mine, job, output_tokens), structured)
    writer = ResultWriter(results_dir, sharding.shard_index, job.output.commit_every_rows,
                          job.output.commit_every_seconds,
                          result_fields(job.task, job.sampling.n > 1, _may_ask_logprobs(job)))
    totals = JobTotals()
    bar = tqdm(total=sum(prepared.manifest.partition_rows[p] for p in mine) * job.sampling.n, desc=job.task,
               unit="req",
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
    stats = job_row(totals, engine.counters, engine.config, time.perf_counter() - started)
    write_stats(stats_dir(out, sharding), totals, engine.counters.steps, stats)
    if job.data.format == "openai_batch" and sharding.num_shards == 1:  # shards: the merge writes it
        write_results_jsonl(results_dir, out / "results.jsonl", job.model.name, prepared.tokenizer.decode_one)
    figure = write_run_figure(stats_dir(out, sharding), "batchprefill") if job.output.plot else None
    print_summary(stats, out, figure)
    return stats


def _committed_ids(job: JobSettings, results_dir) -> set:
    """Ids an earlier run into this output folder already committed, which this run skips; with sampling.n > 1,
    the (id, sample_index) pairs committed (a row runs again unless all its samples are in)."""
    if job.output.resume:
        return done_ids(results_dir, job.data.columns.id, job.sampling.n > 1)
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


def _tokens_needed(prepared: Prepared, partitions: list[int], job: JobSettings, output_tokens: int) -> int:
    """KV slots that would hold every prompt and output of this shard at once: a pool never needs more. With
    task=score the choices' tokens are not in the manifest: twice the contexts' is taken (a pool that is short
    only makes children wait)."""
    manifest = prepared.manifest
    if job.task == "score":
        return sum(2 * manifest.partition_tokens[p] for p in partitions)
    return sum(manifest.partition_tokens[p] for p in partitions) + output_tokens * job.sampling.n


@dataclass
class JobModel:
    """The model loaded for a job, with what every engine built on it shares."""

    loaded: LoadedModel
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    graph_safe_decode: bool


def structured_step(job: JobSettings, prepared: Prepared) -> StructuredOutputs:
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
    return StructuredOutputs(grammars, job.engine.max_num_seqs)


def build_engine(job: JobSettings, prepared: Prepared, tokens_needed: int,
                 structured: StructuredOutputs | None = None) -> Engine:
    """Load the model on the chosen device and backend, size the KV pool, and build the engine around them."""
    model = load_job_model(job, prepared.folder, prepared.model_config, prepared.identity)
    return engine_on(job, model, prepared.tokenizer, tokens_needed, structured)


def load_job_model(job: JobSettings, folder: Path, model_config: ModelConfig, identity: str) -> JobModel:
    settings = job.engine
    device = resolve_device(settings.device)
    keep_freed_memory()
    if device.type == "cpu" and settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    dtype = resolve_dtype(job.model.dtype, device)
    kv_dtype = dtype if settings.kv_cache_dtype == "auto" else resolve_dtype(settings.kv_cache_dtype, device)
    ops = make_ops(settings.attention_backend, device)
    loaded = load_model(folder, dtype, device, ops, model_config, identity)
    return JobModel(loaded, model_config, device, dtype, kv_dtype, ops.graph_safe_decode)


def engine_on(job: JobSettings, model: JobModel, tokenizer: PromptTokenizer, tokens_needed: int,
              structured: StructuredOutputs | None = None) -> Engine:
    """An engine on a loaded model with a KV pool sized for `tokens_needed` (batchprefill-eval builds one per
    batch of lm-eval requests, on one model)."""
    settings, model_config = job.engine, model.config
    loaded, device, dtype, kv_dtype = model.loaded, model.device, model.dtype, model.kv_dtype
    graphs = settings.cuda_graphs and device.type == "cuda" and model.graph_safe_decode
    num_blocks = pool_blocks(model_config, kv_dtype, device, settings.block_size, settings.max_num_seqs,
                             settings.kv_cache_tokens, tokens_needed)
    config = EngineConfig(settings, num_blocks, padded_decode="graphs" if graphs else "off")
    scope = (loaded.identity, str(dtype), str(kv_dtype), model_config.rope_theta, repr(model_config.rope_scaling),
             model_config.layer_windows, settings.block_size, job.model.adapter)
    return Engine(loaded.model, config, tokenizer.decode, scope, kv_dtype, device, structured)


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


def _drive(engine: Engine, requests: Iterator[tuple[PartitionRun, Request]], writer: ResultWriter,
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
            _record(owner[0], request, writer, totals)
            bar.update(1)
            if totals.prompt_tokens:
                bar.set_postfix(hit=f"{totals.cached_tokens / totals.prompt_tokens:.1%}", refresh=False)
            if stop[0]:
                raise Interrupted
    finally:
        writer.commit()


def load_partition(data: DataSettings, block_size: int, params: SamplingParams, prepared: Prepared, part: int,
                   skip: set) -> PartitionRun:
    """Read one partition, drop rows already done, order the rest and turn them into requests: with task=score
    a context request per row carrying its choices, with sampling.n > 1 sample 0 carrying the others."""
    table = read_parquet(partition_path(prepared.partitions_dir, part), None, PARTITION_REMEDY)
    written = skip if params.n > 1 else set()
    if params.n > 1:  # a row is done when all its samples are
        skip = {i for i, count in Counter(i for i, _ in written).items() if count >= params.n}
    if skip:
        table = table.filter(pa.array([i not in skip for i in table[data.columns.id].to_pylist()]))
    sampling = partition_sampling(table, data.columns, params, prepared.model_config.max_positions)
    table = table.set_column(table.schema.get_field_index(ERROR), ERROR, pa.array(sampling.errors, pa.string()))
    if written:
        row_of = dict(zip(table[data.columns.id].to_pylist(), table[ROW].to_pylist()))
        written = {(row_of[i], sample) for i, sample in written if i in row_of}
    order = run_order(table[TOKENS], table[NAMESPACE], table[ROW], table[ERROR], data.order)
    token_ids, namespaces = table[TOKENS].take(order), table[NAMESPACE].take(order)
    rows = table[ROW].take(order).to_pylist()
    if data.columns.choices:
        choices = table[CHOICES].take(order).to_pylist()
        requests = [score_request(row, ids, row_choices, namespace) for row, ids, row_choices, namespace
                    in zip(rows, token_ids.to_pylist(), choices, namespaces.to_pylist())]
    else:
        settings = [sampling.settings[i] for i in sampling.index[order].tolist()]
        requests = [with_samples(Request(row, ids, row_params, namespace)) for row, ids, row_params, namespace
                    in zip(rows, token_ids.to_pylist(), settings, namespaces.to_pylist())]
    link_prefix_donors(requests, shared_with_previous(token_ids, namespaces, block_size))
    errors = [(i, message) for i, message in enumerate(sampling.errors) if message is not None]
    return PartitionRun(part, table, errors, requests, groups(token_ids, namespaces, block_size),
                        dict(zip(rows, order.tolist())), sum(r.sampling.n for r in requests),
                        sum(reusable_tokens(token_ids, namespaces, block_size)), written)


def link_prefix_donors(requests: list[Request], shared_blocks: np.ndarray) -> None:
    """Point each request at the one before it in run order when they share leading full blocks (the order
    stage's count), so the scheduler copies those block keys instead of hashing the same tokens again."""
    for previous, request, shared in zip(requests, requests[1:], shared_blocks[1:].tolist()):
        if shared:
            request.prefix_donor, request.donor_blocks = previous, shared


def _record(run: PartitionRun, request: Request, writer: ResultWriter, totals: JobTotals) -> None:
    """Write a finished request's row; when its partition is done, add the partition's group statistics."""
    index = run.position[request.request_id]
    run.unfinished -= 1
    if (request.request_id, request.sample_index) in run.written:
        return  # an earlier run committed this sample
    writer.add(run.table, index, Outcome(
        request.output_text, request.output_token_ids, request.num_row_prompt_tokens,
        request.num_cached_tokens or 0, request.finish_reason, request.error, _result_columns(request)))
    totals.add_finished(request)
    if run.unfinished == 0:
        totals.add_groups(run.part, run.groups, run.requests)


def _may_ask_logprobs(job: JobSettings) -> bool:
    """Whether rows may carry logprobs: the job asks for them, or the lines of an OpenAI batch file may (each
    line's `logprobs`; the columns are null on the lines that do not ask)."""
    return job.sampling.logprobs is not None or job.data.format == "openai_batch"


def _sample_column(job: JobSettings, sample: int) -> dict:
    return {"sample_index": sample} if job.sampling.n > 1 else {}


def _result_columns(request: Request) -> dict:
    """A finished request's columns beyond the plain output ones (writer.result_fields picks those a job writes)."""
    asked = request.sampling.logprobs is not None  # 0 (an OpenAI line's logprobs alone): the sampled tokens'
    columns: dict = {"sample_index": request.sample_index,
                     "output_logprobs": request.output_logprobs if asked else None,
                     "output_top_logprobs": [[{"token_id": t, "logprob": v} for t, v in top]
                                             for top in request.output_top_logprobs] if asked else None}
    scores = request.score
    if scores is not None and request.error is None:
        columns.update(choice_logprobs=scores.choice_logprobs(), choice_num_tokens=list(map(len, scores.choices)),
                       choice_is_greedy=scores.is_greedy(), best_choice=scores.best_choice())
    return columns
