"""Read and check a job's configuration once, so every later stage gets values it can trust."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from batchprefill.dataset import Columns
from batchprefill.engine.request import SamplingParams
from batchprefill.errors import JobError


@dataclass(frozen=True)
class Sharding:
    num_shards: int
    shard_index: int


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise JobError(message)


def columns(cfg: DictConfig) -> Columns:
    return Columns(prompt=cfg.data.prompt_column, id=cfg.data.id_column, system=cfg.data.system_column,
                   namespace=cfg.data.namespace_column)


def sampling(cfg: DictConfig) -> SamplingParams:
    s = cfg.sampling
    _require(s.max_tokens >= 1, f"sampling.max_tokens={s.max_tokens}: must be at least 1")
    _require(s.temperature >= 0, f"sampling.temperature={s.temperature}: must be >= 0")
    _require(0 < s.top_p <= 1, f"sampling.top_p={s.top_p}: must be in (0, 1]")
    _require(s.top_k == -1 or s.top_k >= 1, f"sampling.top_k={s.top_k}: must be -1 (off) or >= 1")
    stop = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
    _require(all(isinstance(x, str) and x for x in stop), "sampling.stop: give a list of non-empty strings")
    return SamplingParams(max_tokens=int(s.max_tokens), temperature=float(s.temperature), top_p=float(s.top_p),
                          top_k=int(s.top_k), seed=int(s.seed), stop=tuple(stop), ignore_eos=bool(s.ignore_eos))


def check_engine(cfg: DictConfig) -> None:
    e = cfg.engine
    _require(e.block_size >= 1 and (e.block_size & (e.block_size - 1)) == 0,
             f"engine.block_size={e.block_size}: must be a power of two")
    _require(e.max_batched_tokens >= 1, f"engine.max_batched_tokens={e.max_batched_tokens}: must be >= 1")
    _require(e.max_num_seqs >= 1, f"engine.max_num_seqs={e.max_num_seqs}: must be >= 1")
    _require(e.kv_cache_tokens is None or e.kv_cache_tokens >= e.block_size,
             f"engine.kv_cache_tokens={e.kv_cache_tokens}: must hold at least one block")
    _require(cfg.data.order in ("prefix", "input"), f"data.order={cfg.data.order!r}: choose prefix or input")
    _require(cfg.output.commit_every_rows >= 1, "output.commit_every_rows must be >= 1")
    _require(cfg.data.read_batch_rows >= 1 and cfg.data.buffer_mb >= 1,
             "data.read_batch_rows and data.buffer_mb must be >= 1")


def sharding(cfg: DictConfig) -> Sharding:
    """This process's shard: from the config, else from a Slurm array, else the whole job."""
    count = cfg.data.num_shards
    index = cfg.data.shard_index
    if count is None:
        count = int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1))
    if index is None:
        index = int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", 0))
    _require(count >= 1, f"data.num_shards={count}: must be >= 1")
    _require(0 <= index < count, f"data.shard_index={index}: must be in [0, {count})")
    return Sharding(int(count), int(index))


def output_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output.dir).expanduser()
