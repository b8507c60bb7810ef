"""`batchprefill-plan`: what a job would cost and what prefix reuse would save, without running the model.

It prepares the job exactly as `batchprefill-run` does (read, tokenize, partition), then orders and groups
every partition of the whole job (all shards) and adds up a cost model from `config.json` alone.

`ideal_computed_tokens` is the number of prompt tokens a run must compute when each prompt reuses the
full-block prefix it shares with the prompt just before it in run order, always leaving one token to
compute (`order.reusable_tokens`). In prefix order that predecessor is the best partner of any earlier
prompt, so the figure is what an unbounded prefix cache would reach; with `data.order=input` it is what a
cache holding only the current path would reach, the baseline that prefix ordering improves on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from batchprefill.io.atomic import write_records
from batchprefill.io.columns import ADAPTER_SCOPE, ERROR, NAMESPACE, ROW, TOKENS
from batchprefill.model.adapters import check_adapters
from batchprefill.pipeline.manifest import read_partition
from batchprefill.pipeline.order import groups, in_run_order, reusable_tokens, shared_with_previous
from batchprefill.pipeline.prepare import open_model, prepare_job
from batchprefill.pipeline.shard_lock import refuse_beside_live_writer
from batchprefill.report.plan_figure import draw_plan
from batchprefill.report.summary import print_plan_summary
from batchprefill.settings import JobSettings

if TYPE_CHECKING:  # pulls in torch, which the entry point loads only after Hydra parsed the command line
    import torch

    from batchprefill.model.config import ModelConfig

BITS_PER_BYTE = 8

# FLOP counts overflow int64 for large jobs on large models (2 x 1e10 tokens x 7e10 parameters): float64.
PLAN_SCHEMA = pa.schema([
    ("requests", pa.int64()), ("error_rows", pa.int64()), ("prompt_tokens", pa.int64()),
    ("groups", pa.int64()), ("largest_group", pa.int64()), ("ideal_computed_tokens", pa.int64()),
    ("computed_tokens_without_reuse", pa.int64()), ("prefill_flops_with_reuse", pa.float64()),
    ("prefill_flops_without_reuse", pa.float64()), ("kv_bytes_per_token", pa.int64()),
    ("kv_bytes_total", pa.int64()), ("kv_transfer_seconds_mean", pa.float64()),
    ("adapters", pa.int64()),  # LoRA adapters the runnable rows name (the base model not counted)
    # Memory (memory_fit): the weights in the precision the run would hold them, the least KV pool the job runs
    # with, the device's memory (null where unknown) and whether both fit it (null where unknown).
    ("weight_bytes", pa.int64()), ("min_pool_bytes", pa.int64()), ("device_memory_bytes", pa.int64()),
    ("fits_device", pa.bool_()),
])


def attention_pairs(cached: int, fresh: int) -> int:
    """Query-key pairs scored when `fresh` tokens attend to `cached` reused ones and causally to each other."""
    return fresh * cached + fresh * (fresh + 1) // 2


def prefill_flops(tokens: int, params: int, layers: int, q_heads: int, head_dim: int, pairs: int) -> int:
    """Linear layers (2 x tokens x parameters) plus attention (QK^T and PV: 4 x layers x heads x pairs x dim)."""
    return 2 * tokens * params + 4 * layers * q_heads * pairs * head_dim


def transfer_seconds(num_bytes: float, link_gbps: float) -> float:
    """Ideal time to move bytes over a link of `link_gbps` gigabits per second: a lower bound, not a latency."""
    return num_bytes / (link_gbps * 1e9 / BITS_PER_BYTE)


def sharing_depths(token_ids: pa.ChunkedArray, namespaces: pa.ChunkedArray, block_size: int) -> np.ndarray:
    """Per prompt in prefix order: the most full blocks it shares with any other prompt of its namespace.

    In the depth-first order of the trie a prompt's best partner is always one of its two neighbours.
    """
    links = np.concatenate([shared_with_previous(token_ids, namespaces, block_size), [0]])
    return np.maximum(links[:-1], links[1:])


@dataclass
class Tally:
    """Sums over the partitions read so far: the plan needs no row kept in memory."""

    requests: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    pairs_with_reuse: int = 0
    pairs_without_reuse: int = 0
    group_sizes: Counter = field(default_factory=Counter)  # group size -> number of groups
    # full blocks shared with another prompt -> requests; seen within a partition, which in prefix order
    # never splits prompts that share a block
    depths: Counter = field(default_factory=Counter)
    adapters: set = field(default_factory=set)  # adapter names the runnable rows run with
    longest_prompt: int = 0

    def add_partition(self, table: pa.Table, order: str, block_size: int) -> None:
        """Count one partition in the order a run would take it; error rows never reach the engine."""
        run = in_run_order(table, order)
        trie = run if order == "prefix" else in_run_order(table, "prefix")
        count = len(run.order)
        lengths = np.diff(run.token_ids.combine_chunks().offsets.to_numpy()) if count else np.zeros(0, np.int64)
        reused = np.asarray(reusable_tokens(run.token_ids, run.namespaces, block_size), dtype=np.int64)
        fresh = lengths - reused
        self.computed_tokens += int(fresh.sum())
        self.pairs_with_reuse += int(sum(map(attention_pairs, reused.tolist(), fresh.tolist())))
        self.pairs_without_reuse += int(sum(attention_pairs(0, n) for n in lengths.tolist()))
        self.error_rows += table.num_rows - count
        self.requests += count
        self.prompt_tokens += int(lengths.sum())
        self.longest_prompt = max(self.longest_prompt, int(lengths.max(initial=0)))
        self.group_sizes.update(g.stop - g.start for g in groups(run.token_ids, run.namespaces, block_size))
        self.depths.update(sharing_depths(trie.token_ids, trie.namespaces, block_size).tolist())
        scopes = set(run.namespaces.unique().to_pylist()) if count else set()
        self.adapters.update(s.split(ADAPTER_SCOPE, 1)[1] for s in scopes if ADAPTER_SCOPE in s)


def planned_device(job: JobSettings) -> torch.device:
    """The device a run on these settings would take. `engine.device=cuda` is taken at its word: planning a GPU
    job on a login node must not need a GPU."""
    import torch

    from batchprefill.model.loader import resolve_device

    return torch.device("cuda") if job.engine.device == "cuda" else resolve_device(job.engine.device)


def kv_element_bytes(job: JobSettings) -> int:
    """Bytes per KV element as a run on these settings would store them (auto = the model's dtype; fp8: one)."""
    import torch

    from batchprefill.model.loader import resolve_dtype, resolve_kv_dtype

    kv_dtype = resolve_kv_dtype(job.engine.kv_cache_dtype, resolve_dtype(job.model.dtype, planned_device(job)))
    return torch.finfo(kv_dtype).bits // BITS_PER_BYTE


@dataclass(frozen=True)
class MemoryFit:
    """Whether a model and the least KV pool its job runs with fit one device."""

    weight_bytes: int
    min_pool_bytes: int
    device_memory_bytes: int | None  # None: unknown (a GPU job planned where no GPU is visible)
    pool_fraction: float  # the share of what the weights leave that a run gives its pool (engine/kv_cache.py)
    precision: str  # how the weights are held: "bfloat16", "FP8 linears, bfloat16 otherwise"

    @property
    def fits(self) -> bool | None:
        if self.device_memory_bytes is None:
            return None
        return self.min_pool_bytes <= self.pool_fraction * (self.device_memory_bytes - self.weight_bytes)


def weight_bytes(model: ModelConfig, element_bytes: int, fp8_linears: bool, fp8_experts: bool = False) -> int:
    """The weights as a run holds them: the dense linears in one byte each where they multiply in FP8, and a
    mixture-of-experts model's experts where an FP8 checkpoint holds them so (their float32 scales, 4 bytes per
    output row or per 128 x 128 block, are left out), everything else in `element_bytes`."""
    linear_bytes = 1 if fp8_linears else element_bytes
    expert_bytes = 1 if fp8_experts else element_bytes
    return (model.dense_linear_parameters() * linear_bytes + model.expert_parameters() * expert_bytes
            + model.other_parameters() * element_bytes)


def memory_fit(job: JobSettings, model: ModelConfig, longest_prompt: int, kv_bytes: int) -> MemoryFit:
    """From the config alone: the weights in the job's precision (model.dtype, model.quantization and the
    checkpoint's own), and a pool for the job's longest request alone (its prompt and answers, in whole blocks)
    or `engine.kv_cache_tokens`, against `plan.device_memory_gb`, else the visible GPU's (or for a CPU job the
    host's) memory."""
    import os

    import torch

    from batchprefill.engine.kv_cache import CPU_KV_MEMORY_FRACTION, GPU_KV_MEMORY_FRACTION
    from batchprefill.intmath import cdiv
    from batchprefill.model.loader import fp8_multiplies, resolve_dtype
    from batchprefill.model.quantization import job_quantization
    from batchprefill.tasks import get_task

    device = planned_device(job)
    dtype = resolve_dtype(job.model.dtype, device)
    quantization = job_quantization(model.quantization, job.model.quantization)
    fp8 = fp8_multiplies(quantization, dtype, device)
    fp8_experts = fp8 and not quantization.at_load  # a 16-bit checkpoint quantized at load keeps its experts
    block = job.engine.block_size
    tokens = job.engine.kv_cache_tokens or cdiv(
        get_task(job.task).kv_tokens(longest_prompt, job.sampling.max_tokens, job.sampling.n), block) * block
    if job.plan_device_memory_gb is not None:
        memory: int | None = int(job.plan_device_memory_gb * 1e9)
    elif device.type == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fraction = GPU_KV_MEMORY_FRACTION if device.type == "cuda" else CPU_KV_MEMORY_FRACTION
    name = str(dtype).removeprefix("torch.")
    element_bytes = torch.finfo(dtype).bits // BITS_PER_BYTE
    return MemoryFit(weight_bytes(model, element_bytes, fp8, fp8_experts), tokens * kv_bytes, memory,
                     fraction, f"FP8 linears, {name} otherwise" if fp8 else name)


def plan_row(tally: Tally, model: ModelConfig, element_bytes: int, link_gbps: float, memory: MemoryFit) -> dict:
    """The one row of plan.parquet from the tally, the model's shape and its memory."""
    params, layers = model.num_parameters(), model.num_layers
    per_token = model.kv_bytes_per_token(element_bytes)
    kv_total = tally.prompt_tokens * per_token
    return {
        "requests": tally.requests, "error_rows": tally.error_rows, "prompt_tokens": tally.prompt_tokens,
        "groups": sum(tally.group_sizes.values()), "largest_group": max(tally.group_sizes, default=0),
        "ideal_computed_tokens": tally.computed_tokens, "computed_tokens_without_reuse": tally.prompt_tokens,
        "prefill_flops_with_reuse": float(prefill_flops(tally.computed_tokens, params, layers, model.num_heads,
                                                        model.head_dim, tally.pairs_with_reuse)),
        "prefill_flops_without_reuse": float(prefill_flops(tally.prompt_tokens, params, layers, model.num_heads,
                                                           model.head_dim, tally.pairs_without_reuse)),
        "kv_bytes_per_token": per_token, "kv_bytes_total": kv_total,
        "kv_transfer_seconds_mean": transfer_seconds(kv_total / tally.requests, link_gbps) if tally.requests else 0.0,
        "adapters": len(tally.adapters),
        "weight_bytes": memory.weight_bytes, "min_pool_bytes": memory.min_pool_bytes,
        "device_memory_bytes": memory.device_memory_bytes, "fits_device": memory.fits,
    }


def plan_job(job: JobSettings) -> dict:
    """Prepare the job as a run would, tally every partition of every shard, write plan.parquet and plan.png."""
    refuse_beside_live_writer(job.output.dir, job.output.lease_seconds, "batchprefill-plan")
    model = open_model(job.model)
    check_adapters(job.model.adapters, model.config)  # what the run would refuse, refused before the run
    prepared = prepare_job(job, model)
    block_size = job.engine.block_size
    tally = Tally()
    for part, num_rows in enumerate(prepared.manifest.partition_rows):
        if num_rows:  # an empty partition's file holds nothing to count
            table = read_partition(prepared.partitions_dir, part, [TOKENS, ERROR, NAMESPACE, ROW])
            tally.add_partition(table, job.data.order, block_size)
    config, element_bytes = prepared.model.config, kv_element_bytes(job)
    memory = memory_fit(job, config, tally.longest_prompt, config.kv_bytes_per_token(element_bytes))
    row = plan_row(tally, config, element_bytes, job.plan_link_gbps, memory)
    out = job.output.dir
    write_records([row], out / "plan.parquet", PLAN_SCHEMA)
    draw_plan(row, tally.depths, tally.group_sizes, block_size, out / "plan.png")
    print_plan_summary(row, job.plan_link_gbps, out, memory.precision)
    return row

