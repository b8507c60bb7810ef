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
from batchprefill.pipeline.manifest import read_partition
from batchprefill.pipeline.order import groups, in_run_order, reusable_tokens, shared_with_previous
from batchprefill.pipeline.prepare import prepare_job
from batchprefill.report.plan_figure import draw_plan
from batchprefill.report.summary import print_plan_summary
from batchprefill.settings import JobSettings

if TYPE_CHECKING:  # pulls in torch, which the entry point loads only after Hydra parsed the command line
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
        self.group_sizes.update(g.stop - g.start for g in groups(run.token_ids, run.namespaces, block_size))
        self.depths.update(sharing_depths(trie.token_ids, trie.namespaces, block_size).tolist())
        scopes = set(run.namespaces.unique().to_pylist()) if count else set()
        self.adapters.update(s.split(ADAPTER_SCOPE, 1)[1] for s in scopes if ADAPTER_SCOPE in s)


def kv_element_bytes(job: JobSettings) -> int:
    """Bytes per KV element as a run on these settings would store them (auto = the model's dtype).

    `engine.device=cuda` is taken at its word: planning a GPU job on a login node must not need a GPU.
    """
    import torch

    from batchprefill.model.loader import resolve_device, resolve_dtype, resolve_kv_dtype

    device = torch.device("cuda") if job.engine.device == "cuda" else resolve_device(job.engine.device)
    kv_dtype = resolve_kv_dtype(job.engine.kv_cache_dtype, resolve_dtype(job.model.dtype, device))
    return torch.finfo(kv_dtype).bits // BITS_PER_BYTE


def plan_row(tally: Tally, model: ModelConfig, element_bytes: int, link_gbps: float) -> dict:
    """The one row of plan.parquet from the tally and the model's shape."""
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
    }


def plan_job(job: JobSettings) -> dict:
    """Prepare the job as a run would, tally every partition of every shard, write plan.parquet and plan.png."""
    prepared = prepare_job(job)
    block_size = job.engine.block_size
    tally = Tally()
    for part, num_rows in enumerate(prepared.manifest.partition_rows):
        if num_rows:  # an empty partition's file holds nothing to count
            table = read_partition(prepared.partitions_dir, part, [TOKENS, ERROR, NAMESPACE, ROW])
            tally.add_partition(table, job.data.order, block_size)
    row = plan_row(tally, prepared.model.config, kv_element_bytes(job), job.plan_link_gbps)
    out = job.output.dir
    write_records([row], out / "plan.parquet", PLAN_SCHEMA)
    draw_plan(row, tally.depths, tally.group_sizes, block_size, out / "plan.png")
    print_plan_summary(row, job.plan_link_gbps, out)
    return row

