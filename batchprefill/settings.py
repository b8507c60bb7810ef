"""The job's configuration, read and checked once at the entry point, as typed settings per stage.

Hydra hands every command one `DictConfig`; `JobSettings.from_config` turns it into plain frozen
dataclasses, one per stage (data, model, engine, sampling, output), and raises a one-line `JobError` for
any value out of range. Each stage then receives only its part, so a new key has one place to land and be
checked, and no stage reads the raw config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from omegaconf import DictConfig

from batchprefill.constraint import GrammarError, job_constraint
from batchprefill.engine.config import EngineSettings
from batchprefill.errors import JobError
from batchprefill.io.columns import Columns
from batchprefill.io.formats import FORMATS, input_format
from batchprefill.pooling_params import POOLINGS, PoolingParams
from batchprefill.sampling_params import SamplingParams
from batchprefill.tasks import Task, get_task

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")  # conf/config.yaml: every command's Hydra config


@dataclass(frozen=True)
class Sharding:
    num_shards: int
    shard_index: int


@dataclass(frozen=True)
class DataSettings:
    input: str | None
    format: str
    columns: Columns
    chat_template: bool
    order: str  # "prefix" or "input"
    sharding: Sharding
    configured_shards: int | None  # data.num_shards as given: the merge falls back on what the stats say
    read_batch_rows: int
    buffer_mb: int


@dataclass(frozen=True)
class ModelSettings:
    name: str  # the config group's name; OpenAI results name it as their model
    path: str | None  # null = the shipped GGUF
    dtype: str  # auto | float32 | bfloat16 | float16
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> its PEFT folder
    pooling: PoolingParams = PoolingParams()  # model.pooling and model.normalize (task=embed)


@dataclass(frozen=True)
class OutputSettings:
    dir: Path
    resume: bool
    commit_every_rows: int
    commit_every_seconds: float
    progress: bool
    plot: bool  # draw stats/run.png after the run and the merge
    # another host's run that stopped renewing its lease on a shard this long is gone (pipeline.shard_lock)
    lease_seconds: float = 120.0


@dataclass(frozen=True)
class JobSettings:
    data: DataSettings
    model: ModelSettings
    engine: EngineSettings
    sampling: SamplingParams
    output: OutputSettings
    plan_link_gbps: float
    task: str = "generate"  # a name in tasks.TASKS

    @classmethod
    def from_config(cls, cfg: DictConfig) -> JobSettings:
        name = str(cfg.get("task", "generate"))
        task = get_task(name)
        sampling = _sampling(cfg)
        task.check(sampling)
        return cls(data=_data(cfg, task), model=_model(cfg), engine=_engine(cfg), sampling=sampling,
                   output=_output(cfg), plan_link_gbps=_link_gbps(cfg), task=name)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise JobError(message)


def _data(cfg: DictConfig, task: Task) -> DataSettings:
    d = cfg.data
    _require(d.order in ("prefix", "input"), f"data.order={d.order!r}: choose prefix or input")
    _require(d.read_batch_rows >= 1 and d.buffer_mb >= 1, "data.read_batch_rows and data.buffer_mb must be >= 1")
    columns = replace(_columns(d), task_columns=_task_columns(d, task))
    return DataSettings(
        input=d.input, format=d.format, columns=columns, chat_template=bool(d.chat_template), order=d.order,
        sharding=_sharding(d.num_shards, d.shard_index), configured_shards=d.num_shards,
        read_batch_rows=int(d.read_batch_rows), buffer_mb=int(d.buffer_mb),
    )


def _columns(d: DictConfig) -> Columns:
    """The columns the data.*_column keys name, as the format reads them (a format may have columns of its own)."""
    messages = d.get("messages_column")
    return input_format(d.format).columns(Columns(
        prompt=None if messages else d.prompt_column, id=d.id_column, system=d.system_column,
        namespace=d.namespace_column, messages=messages, schema=d.get("schema_column"),
        adapter=d.get("adapter_column")))


def _task_columns(d: DictConfig, task: Task) -> tuple[tuple[str, str], ...]:
    """The input columns the task reads besides the prompt, as (data.* key, column name): each key must be set,
    and a format whose columns are its own (an OpenAI batch file) has none to give."""
    if not task.input_columns:
        return ()
    *open_formats, last = [name for name, fmt in FORMATS.items() if not fmt.fixed_columns]
    _require(not input_format(d.format).fixed_columns,
             f"task={task.name} reads {', '.join(open_formats)} or {last} input, not data.format={d.format}")
    for key, meaning in task.input_columns:
        _require(bool(d.get(key)), f"task={task.name} needs data.{key}: {meaning}")
    return tuple((key, str(d[key])) for key, _ in task.input_columns)


def _sharding(count: int | None, index: int | None) -> Sharding:
    """This process's shard: from the config, else from a Slurm array, else the whole job."""
    if count is None:
        count = int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1))
    if index is None:
        index = int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", 0))
    _require(count >= 1, f"data.num_shards={count}: must be >= 1")
    _require(0 <= index < count, f"data.shard_index={index}: must be in [0, {count})")
    return Sharding(int(count), int(index))


def _model(cfg: DictConfig) -> ModelSettings:
    m = cfg.model
    adapters = m.get("adapters") or {}
    for name, folder in adapters.items():
        _require(isinstance(name, str) and bool(name.strip()) and isinstance(folder, str) and bool(folder),
                 f"model.adapters: {name!r}={folder!r}: give each adapter a name and its PEFT folder "
                 "(+model.adapters.NAME=/path/to/adapter)")
    pooling = str(m.get("pooling", "last"))
    _require(pooling in POOLINGS, f"model.pooling={pooling!r}: choose {' or '.join(POOLINGS)}")
    return ModelSettings(name=str(m.name), path=m.path, dtype=str(m.dtype),
                         adapters={str(name): str(folder) for name, folder in adapters.items()},
                         pooling=PoolingParams(pooling, bool(m.get("normalize", True))))


def _engine(cfg: DictConfig) -> EngineSettings:
    e = cfg.engine
    _require(e.block_size >= 1 and (e.block_size & (e.block_size - 1)) == 0,
             f"engine.block_size={e.block_size}: must be a power of two")
    _require(e.kv_cache_tokens is None or e.kv_cache_tokens >= e.block_size,
             f"engine.kv_cache_tokens={e.kv_cache_tokens}: must hold at least one block")
    return EngineSettings(
        device=str(e.device), attention_backend=str(e.attention_backend), block_size=int(e.block_size),
        max_batched_tokens=_count_or_auto("engine.max_batched_tokens", e.max_batched_tokens),
        max_num_seqs=_count_or_auto("engine.max_num_seqs", e.max_num_seqs),
        kv_cache_tokens=None if e.kv_cache_tokens is None else int(e.kv_cache_tokens),
        prefix_caching=bool(e.prefix_caching), kv_cache_dtype=str(e.kv_cache_dtype),
        cache_namespace=str(e.cache_namespace), reserve_output_blocks=bool(e.reserve_output_blocks),
        num_threads=int(e.num_threads) if e.num_threads else None, cuda_graphs=bool(e.cuda_graphs),
        batch_invariant=bool(e.batch_invariant),
    )


def _count_or_auto(key: str, value: object) -> int | str:
    """A positive whole number, or "auto" (pipeline/engine_sizes.py picks it once the device is known)."""
    if value == "auto":
        return "auto"
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
             f"{key}={value!r}: give a whole number >= 1 or auto")
    return int(value)


def _sampling(cfg: DictConfig) -> SamplingParams:
    s = cfg.sampling
    _require(s.max_tokens >= 1, f"sampling.max_tokens={s.max_tokens}: must be at least 1")
    _require(s.temperature >= 0, f"sampling.temperature={s.temperature}: must be >= 0")
    _require(0 < s.top_p <= 1, f"sampling.top_p={s.top_p}: must be in (0, 1]")
    _require(s.top_k == -1 or s.top_k >= 1, f"sampling.top_k={s.top_k}: must be -1 (off) or >= 1")
    stop = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
    _require(all(isinstance(x, str) and x for x in stop), "sampling.stop: give a list of non-empty strings")
    n, logprobs = int(s.get("n", 1)), s.get("logprobs")
    _require(n >= 1, f"sampling.n={n}: must be at least 1")
    _require(logprobs is None or int(logprobs) >= 1, f"sampling.logprobs={logprobs}: must be null (off) or >= 1")
    try:
        constraint = job_constraint(s.get("json_schema"), s.get("regex"),
                                    None if s.get("choice") is None else list(s.choice))
    except GrammarError as error:
        raise JobError(str(error)) from None
    return SamplingParams(max_tokens=int(s.max_tokens), temperature=float(s.temperature), top_p=float(s.top_p),
                          top_k=int(s.top_k), seed=int(s.seed), stop=tuple(stop), ignore_eos=bool(s.ignore_eos),
                          n=n, logprobs=None if logprobs is None else int(logprobs), constraint=constraint)


def _output(cfg: DictConfig) -> OutputSettings:
    o = cfg.output
    _require(o.commit_every_rows >= 1, "output.commit_every_rows must be >= 1")
    _require(o.lease_seconds > 0, "output.lease_seconds must be > 0")
    return OutputSettings(dir=Path(o.dir).expanduser(), resume=bool(o.resume),
                          commit_every_rows=int(o.commit_every_rows),
                          commit_every_seconds=float(o.commit_every_seconds), progress=bool(o.progress),
                          plot=bool(o.plot), lease_seconds=float(o.lease_seconds))


def _link_gbps(cfg: DictConfig) -> float:
    link = cfg.plan.link_gbps
    _require(link > 0, f"plan.link_gbps={link}: must be > 0")
    return float(link)
