"""A job's statistics: running totals while it runs, then stats/{job,groups,steps}.parquet."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from batchprefill.engine.config import EngineConfig
from batchprefill.engine.counters import EngineCounters, StepStats
from batchprefill.engine.request import Request
from batchprefill.io.atomic import write_records
from batchprefill.settings import Sharding

GROUP_SCHEMA = pa.schema([("group_id", pa.int64()), ("num_requests", pa.int64()),
                          ("shared_prefix_tokens", pa.int64()), ("prompt_tokens", pa.int64()),
                          ("cached_tokens", pa.int64()), ("computed_prompt_tokens", pa.int64()),
                          ("adapter", pa.string())])  # the group's LoRA adapter (model.adapters); null: the base


ADAPTER_COUNTS = ("num_requests", "num_errors", "prompt_tokens", "cached_tokens", "output_tokens")
# With model.adapters: what each adapter's rows cost (rows that never reached the engine are not in it).
ADAPTER_SCHEMA = pa.schema([("adapter", pa.string()), *((name, pa.int64()) for name in ADAPTER_COUNTS),
                            ("computed_prompt_tokens", pa.int64())])


class PrefixGroup(Protocol):
    """A prefix group as the order stage finds it (pipeline.order.Group): a run of requests in run order."""

    start: int
    stop: int
    shared_prefix_tokens: int


@dataclass
class JobTotals:
    num_requests: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ideal_cached_tokens: int = 0  # what an ideal cache serves in this run order, summed as partitions load
    group_rows: list[dict] = field(default_factory=list)
    adapter_names: list[str | None] = field(default_factory=lambda: [None])  # by adapter index; 0: the base model
    by_adapter: dict[int, dict] = field(default_factory=dict)  # adapter index -> its rows' counts (ADAPTER_SCHEMA)

    def add_error_row(self) -> None:
        self.num_requests += 1
        self.num_errors += 1

    def add_finished(self, request: Request) -> None:
        self.num_requests += 1
        self.num_errors += request.error is not None
        self.prompt_tokens += request.num_row_prompt_tokens
        self.cached_tokens += request.num_cached_tokens or 0
        self.output_tokens += len(request.output_token_ids)
        if len(self.adapter_names) > 1:
            counts = self.by_adapter.setdefault(request.adapter, dict.fromkeys(ADAPTER_COUNTS, 0))
            counts["num_requests"] += 1
            counts["num_errors"] += request.error is not None
            counts["prompt_tokens"] += request.num_row_prompt_tokens
            counts["cached_tokens"] += request.num_cached_tokens or 0
            counts["output_tokens"] += len(request.output_token_ids)

    def adapter_rows(self) -> list[dict]:
        """stats/adapters.parquet: one row per adapter that ran (null: the base model), in index order."""
        return [{"adapter": self.adapter_names[index], **counts,
                 "computed_prompt_tokens": counts["prompt_tokens"] - counts["cached_tokens"]}
                for index, counts in sorted(self.by_adapter.items())]

    def add_groups(self, part: int, run_groups: list[PrefixGroup], requests: list[Request]) -> None:
        """One stats/groups.parquet row per prefix group of a finished partition (ids unique across partitions)."""
        for number, group in enumerate(run_groups):
            members = requests[group.start : group.stop]
            prompt = sum(r.num_row_prompt_tokens for r in members)
            cached = sum(r.num_cached_tokens or 0 for r in members)
            self.group_rows.append({
                "group_id": (part << 32) | number, "num_requests": len(members),
                "shared_prefix_tokens": group.shared_prefix_tokens, "prompt_tokens": prompt,
                "cached_tokens": cached, "computed_prompt_tokens": prompt - cached,
                "adapter": self.adapter_names[members[0].adapter]})


def job_row(totals: JobTotals, counters: EngineCounters, config: EngineConfig, wall: float) -> dict:
    steps = counters.steps
    computed = totals.prompt_tokens - totals.cached_tokens
    return {
        "num_requests": totals.num_requests, "num_errors": totals.num_errors,
        "prompt_tokens": totals.prompt_tokens, "cached_tokens": totals.cached_tokens,
        "computed_prompt_tokens": computed, "output_tokens": totals.output_tokens, "wall_seconds": wall,
        "prefill_tokens_per_second": computed / wall if wall else 0.0,
        "output_tokens_per_second": totals.output_tokens / wall if wall else 0.0,
        "cache_hit_rate": totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
        "ideal_cached_tokens": totals.ideal_cached_tokens,
        "max_batched_tokens": config.settings.max_batched_tokens,
        "evicted_blocks": counters.evicted_blocks, "preemptions": counters.preemptions,
        "active_blocks": max((s.active_blocks for s in steps), default=0),
        "reclaimable_blocks": max((s.reclaimable_blocks for s in steps), default=0),
        "free_blocks": max((s.free_blocks for s in steps), default=config.num_blocks),
    }


def stats_dir(out: Path, sharding: Sharding) -> Path:
    """One shard writes `stats/`; shards of a larger job each write their own, which the merge combines."""
    if sharding.num_shards == 1:
        return out / "stats"
    return out / "stats" / f"shard-{sharding.shard_index:04d}-of-{sharding.num_shards:04d}"


def write_stats(folder: Path, totals: JobTotals, steps: list[StepStats], job: dict) -> None:
    write_records(totals.group_rows, folder / "groups.parquet", GROUP_SCHEMA)
    write_records([job], folder / "job.parquet")
    write_records([asdict(s) for s in steps], folder / "steps.parquet")
    if len(totals.adapter_names) > 1:
        write_records(totals.adapter_rows(), folder / "adapters.parquet", ADAPTER_SCHEMA)

