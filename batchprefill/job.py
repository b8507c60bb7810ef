"""A whole job: prepare partitions, run this shard's partitions through the engine, write everything out."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from batchprefill import settings
from batchprefill.dataset import resolve_input
from batchprefill.engine.engine import Engine, EngineConfig
from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.malloc import keep_freed_memory
from batchprefill.model.config import ModelConfig
from batchprefill.model.loader import (
    load_model,
    make_ops,
    model_identity,
    read_model_config,
    resolve_device,
    resolve_dtype,
    resolve_folder,
)
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.order import Group, assign_shards, groups, prefix_order
from batchprefill.prepare import (
    ERROR,
    NAMESPACE,
    PARTITION_SCHEMA,
    PARTITIONS_PER_SHARD,
    ROW,
    TOKENS,
    Manifest,
    PrepareSettings,
    partition_path,
    partition_records,
    prepare,
)
from batchprefill.writer import Outcome, ResultWriter, done_ids, write_records

CPU_KV_MEMORY_FRACTION = 0.25
GPU_KV_MEMORY_FRACTION = 0.8


@dataclass
class JobTotals:
    num_requests: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    group_rows: list[dict] = field(default_factory=list)


class Interrupted(Exception):
    """SIGTERM arrived (Slurm preemption or time limit): commit what finished and stop."""


@dataclass
class Prepared:
    """Everything the plan command and the run share: the model's config, tokenizer and partitions."""

    folder: Path
    model_config: ModelConfig
    tokenizer: PromptTokenizer
    manifest: Manifest
    partitions_dir: Path
    sharding: settings.Sharding


def prepare_job(cfg: DictConfig) -> Prepared:
    settings.check_engine(cfg)
    params = settings.sampling(cfg)
    sharding = settings.sharding(cfg)
    files, fmt = resolve_input(cfg.data.input, cfg.data.format)
    folder = resolve_folder(cfg.model.path)
    model_config = read_model_config(folder)
    tokenizer = PromptTokenizer(folder)
    if cfg.data.chat_template and tokenizer.chat_template is None:
        raise JobError(f"data.chat_template=true but {folder} has no chat template")
    prepare_settings = PrepareSettings(
        columns=settings.columns(cfg), chat_template=bool(cfg.data.chat_template), order=cfg.data.order,
        block_size=int(cfg.engine.block_size),
        max_prompt_tokens=model_config.max_positions - params.max_tokens,
        tokenizer_id=model_identity(folder), read_batch_rows=int(cfg.data.read_batch_rows),
        buffer_mb=int(cfg.data.buffer_mb), min_partitions=PARTITIONS_PER_SHARD * sharding.num_shards,
    )
    partitions_dir = settings.output_dir(cfg) / "partitions"
    manifest = prepare(files, fmt, prepare_settings, tokenizer, partitions_dir, bool(cfg.output.progress))
    return Prepared(folder, model_config, tokenizer, manifest, partitions_dir, sharding)


def run_job(cfg: DictConfig) -> dict:
    """Run the job this config describes; returns the job statistics row."""
    started = time.perf_counter()
    prepared = prepare_job(cfg)
    params = settings.sampling(cfg)
    out = settings.output_dir(cfg)
    columns = settings.columns(cfg)
    results_dir = out / "results"
    skip = done_ids(results_dir, columns.id) if cfg.output.resume else set()
    if not cfg.output.resume and any(results_dir.glob("part-*.parquet")):
        raise JobError(f"{results_dir} already holds results and output.resume=false: choose another output.dir")
    shards = assign_shards(prepared.manifest.partition_tokens, prepared.sharding.num_shards)
    write_records(partition_records(prepared.manifest, shards), out / "stats" / "partitions.parquet", PARTITION_SCHEMA)
    # An empty partition has nothing to run.
    mine = [p for p in shards[prepared.sharding.shard_index] if prepared.manifest.partition_rows[p]]

    device = resolve_device(cfg.engine.device)
    keep_freed_memory()
    if device.type == "cpu" and cfg.engine.num_threads:
        torch.set_num_threads(int(cfg.engine.num_threads))
    dtype = resolve_dtype(cfg.model.dtype, device)
    kv_dtype = resolve_dtype(cfg.engine.kv_cache_dtype, device) if cfg.engine.kv_cache_dtype != "auto" else dtype
    ops = make_ops(cfg.engine.attention_backend, device)
    loaded = load_model(prepared.folder, dtype, device, ops)
    graphs = cfg.engine.cuda_graphs and device.type == "cuda" and ops.graph_safe_decode
    engine_config = EngineConfig(
        block_size=int(cfg.engine.block_size), max_batched_tokens=int(cfg.engine.max_batched_tokens),
        max_num_seqs=int(cfg.engine.max_num_seqs),
        num_blocks=_num_blocks(cfg, prepared.model_config, kv_dtype, device,
                               _tokens_needed(prepared, mine, params.max_tokens)),
        prefix_caching=bool(cfg.engine.prefix_caching), cache_namespace=str(cfg.engine.cache_namespace),
        reserve_output_blocks=bool(cfg.engine.reserve_output_blocks), padded_decode="graphs" if graphs else "off",
    )
    scope = (loaded.identity, str(dtype), str(kv_dtype), prepared.model_config.rope_theta,
             repr(prepared.model_config.rope_scaling), prepared.model_config.layer_windows, engine_config.block_size,
             cfg.model.adapter)
    engine = Engine(loaded.model, engine_config, prepared.tokenizer.decode, scope, kv_dtype, device)

    writer = ResultWriter(results_dir, prepared.sharding.shard_index, int(cfg.output.commit_every_rows),
                          float(cfg.output.commit_every_seconds))
    totals = JobTotals()
    total_rows = sum(prepared.manifest.partition_rows[p] for p in mine)
    bar = tqdm(total=total_rows, desc="generate", unit="req", disable=not cfg.output.progress)
    interrupted = _trap_sigterm()
    owners: dict[int, PartitionRun] = {}  # request id -> the partition it came from

    def feed():
        """Requests of every partition in turn: the next partition starts while the last one drains."""
        for part in mine:
            run = _load_partition(cfg, part, prepared, params, skip)
            for index, message in run.errors:
                writer.add(run.table, index, Outcome("", [], 0, 0, "error", message))
                totals.num_requests += 1
                totals.num_errors += 1
                bar.update(1)
            if not run.requests:
                continue
            for request in run.requests:
                if interrupted[0]:
                    raise Interrupted
                owners[request.request_id] = run
                yield request

    try:
        for request in engine.generate(feed(), lookahead=2 * int(cfg.engine.max_num_seqs)):
            _record(owners.pop(request.request_id), request, writer, totals)
            bar.update(1)
            if totals.prompt_tokens:
                bar.set_postfix(hit=f"{totals.cached_tokens / totals.prompt_tokens:.1%}", refresh=False)
            if interrupted[0]:
                raise Interrupted
        writer.commit()
    except Interrupted:
        writer.commit()
        bar.close()
        print(f"batchprefill: stopped by SIGTERM after committing {writer.committed_rows} rows; "
              "rerun with the same output.dir to resume", file=sys.stderr)
        sys.exit(143)
    bar.close()
    job = _job_stats(totals, engine, time.perf_counter() - started)
    _write_stats(out, prepared.sharding, totals, engine, job)
    _print_summary(job, out)
    return job


def _trap_sigterm() -> list[bool]:
    flag = [False]

    def handler(signum, frame):
        flag[0] = True

    signal.signal(signal.SIGTERM, handler)
    return flag


def _tokens_needed(prepared: Prepared, partitions: list[int], max_tokens: int) -> int:
    """KV slots that would hold every prompt and output of this shard at once: a pool never needs more."""
    manifest = prepared.manifest
    return sum(manifest.partition_tokens[p] + manifest.partition_rows[p] * max_tokens for p in partitions)


def _num_blocks(cfg: DictConfig, model: ModelConfig, kv_dtype: torch.dtype, device: torch.device,
                tokens_needed: int) -> int:
    """The pool from engine.kv_cache_tokens, else from free memory; either way capped at what the shard can
    use, so a generous setting costs no memory (and no time zeroing it) on a small job."""
    size = int(cfg.engine.block_size)
    usable = -(-tokens_needed // size) + int(cfg.engine.max_num_seqs)
    if cfg.engine.kv_cache_tokens is not None:
        return max(1, min(int(cfg.engine.kv_cache_tokens) // size, usable))
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * torch.finfo(kv_dtype).bits // 8
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] * GPU_KV_MEMORY_FRACTION
    else:
        free = _available_memory() * CPU_KV_MEMORY_FRACTION
    return max(1, min(int(free // (per_token * size)), usable))


def _available_memory() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


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


def _load_partition(cfg, part: int, prepared: Prepared, params, skip: set) -> PartitionRun:
    """Read one partition, drop rows already done, order the rest and turn them into requests."""
    table = pq.read_table(partition_path(prepared.partitions_dir, part))
    if skip:
        table = table.filter(pa.array([i not in skip for i in table[cfg.data.id_column].to_pylist()]))
    messages = table[ERROR].to_pylist()
    valid = [i for i, message in enumerate(messages) if message is None]
    token_ids = table[TOKENS].to_pylist()
    namespaces = table[NAMESPACE].to_pylist()
    rows = table[ROW].to_pylist()
    if cfg.data.order == "prefix":
        order = [valid[i] for i in prefix_order([token_ids[i] for i in valid], [namespaces[i] for i in valid])]
    else:
        order = sorted(valid, key=lambda i: rows[i])
    ordered_tokens = [token_ids[i] for i in order]
    run_groups = groups(ordered_tokens, [namespaces[i] for i in order], int(cfg.engine.block_size))
    requests = [Request(rows[i], ordered_tokens[k], params, namespaces[i]) for k, i in enumerate(order)]
    errors = [(i, message) for i, message in enumerate(messages) if message is not None]
    return PartitionRun(part, table, errors, requests, run_groups, {rows[i]: i for i in order}, len(requests))


def _record(run: PartitionRun, request: Request, writer: ResultWriter, totals: JobTotals) -> None:
    """Write a finished request's row; when its partition is done, add the partition's group statistics."""
    cached = request.num_cached_tokens or 0
    writer.add(run.table, run.position[request.request_id], Outcome(
        request.output_text, request.output_token_ids, request.num_prompt_tokens, cached,
        request.finish_reason, request.error))
    totals.num_requests += 1
    totals.num_errors += request.error is not None
    totals.prompt_tokens += request.num_prompt_tokens
    totals.cached_tokens += cached
    totals.output_tokens += len(request.output_token_ids)
    run.unfinished -= 1
    if run.unfinished == 0:
        totals.group_rows.extend(_group_rows(run.part, run.groups, run.requests))


def _group_rows(part: int, run_groups: list[Group], requests: list[Request]) -> list[dict]:
    rows = []
    for number, group in enumerate(run_groups):
        members = requests[group.start : group.stop]
        prompt = sum(r.num_prompt_tokens for r in members)
        cached = sum(r.num_cached_tokens or 0 for r in members)
        rows.append({"group_id": (part << 32) | number, "num_requests": len(members),
                     "shared_prefix_tokens": group.shared_prefix_tokens, "prompt_tokens": prompt,
                     "cached_tokens": cached, "computed_prompt_tokens": prompt - cached})
    return rows


def _job_stats(totals: JobTotals, engine: Engine, wall: float) -> dict:
    steps = engine.counters.steps
    computed = totals.prompt_tokens - totals.cached_tokens
    return {
        "num_requests": totals.num_requests, "num_errors": totals.num_errors,
        "prompt_tokens": totals.prompt_tokens, "cached_tokens": totals.cached_tokens,
        "computed_prompt_tokens": computed, "output_tokens": totals.output_tokens, "wall_seconds": wall,
        "prefill_tokens_per_second": computed / wall if wall else 0.0,
        "output_tokens_per_second": totals.output_tokens / wall if wall else 0.0,
        "cache_hit_rate": totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
        "evicted_blocks": engine.pool.evictions, "preemptions": engine.scheduler.preemptions,
        "active_blocks": max((s.active_blocks for s in steps), default=0),
        "reclaimable_blocks": max((s.reclaimable_blocks for s in steps), default=0),
        "free_blocks": max((s.free_blocks for s in steps), default=engine.pool.num_blocks),
    }


GROUP_SCHEMA = pa.schema([("group_id", pa.int64()), ("num_requests", pa.int64()),
                          ("shared_prefix_tokens", pa.int64()), ("prompt_tokens", pa.int64()),
                          ("cached_tokens", pa.int64()), ("computed_prompt_tokens", pa.int64())])


def stats_dir(out: Path, sharding: settings.Sharding) -> Path:
    """One shard writes `stats/`; shards of a larger job each write their own, which the merge combines."""
    if sharding.num_shards == 1:
        return out / "stats"
    return out / "stats" / f"shard-{sharding.shard_index:04d}-of-{sharding.num_shards:04d}"


def _write_stats(out: Path, sharding: settings.Sharding, totals: JobTotals, engine: Engine, job: dict) -> None:
    folder = stats_dir(out, sharding)
    write_records(totals.group_rows, folder / "groups.parquet", GROUP_SCHEMA)
    write_records([job], folder / "job.parquet")
    write_records([asdict(s) for s in engine.counters.steps], folder / "steps.parquet")


def _print_summary(job: dict, out: Path) -> None:
    print(
        f"batchprefill: {job['num_requests']} requests ({job['num_errors']} errors) in {job['wall_seconds']:.1f} s. "
        f"Of {job['prompt_tokens']} prompt tokens, {job['cached_tokens']} came from the prefix cache "
        f"({job['cache_hit_rate']:.1%}) and {job['computed_prompt_tokens']} were computed "
        f"({job['prefill_tokens_per_second']:.0f} tokens/s); {job['output_tokens']} tokens were generated "
        f"({job['output_tokens_per_second']:.1f} tokens/s). {job['evicted_blocks']} blocks were evicted and "
        f"{job['preemptions']} requests preempted. Results and statistics are in {out}.",
        file=sys.stderr,
    )
