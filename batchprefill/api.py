"""The command line's jobs called from Python: `run`, `Runner` and `plan` (INTERFACE.md, "Python API").

One path with the commands: the keyword arguments become the command line's overrides (`key=value`, each value
quoted so that Hydra reads back exactly the Python value), Hydra composes them on the same `conf/`, and the job
starts through the same `cli.app.checked_job` (settings.py's checks, a writable output.dir) and runs the same
`pipeline.run.run_job` / `pipeline.plan.plan_job`. A fault the command line reports as its one line is raised as
`JobError` with that line as its message.

In-memory data (a polars or pandas DataFrame, a pyarrow Table, a `datasets.Dataset`, a list of prompts) is written
to `input.parquet` in the job's output folder and read back as `data.input`, so it takes the path a file takes:
the same checks, tokenizing, ordering and resume.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from numbers import Integral, Real
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from batchprefill.cli.app import checked_job, config_error, one_line, user_fault
from batchprefill.config_keys import KEYS
from batchprefill.errors import JobError
from batchprefill.io.columns import ROW
from batchprefill.io.own_files import read_parquet
from batchprefill.io.results import RESUME_REMEDY, SAMPLE_INDEX
from batchprefill.pipeline.manifest import PARTITION_REMEDY
from batchprefill.settings import CONFIG_DIR, JobSettings
from batchprefill.units import a_type

if TYPE_CHECKING:  # torch: loaded when a job runs, not when batchprefill.api is imported
    from batchprefill.pipeline.build_engine import JobModel

STAGED_INPUT = "input.parquet"  # in-memory data, written into the job's output folder
PER_CALL_SECTIONS = ("task", "data", "sampling", "output")  # what a Runner's call may change: not model, engine
MODEL_GROUPS = {path.stem for path in (Path(CONFIG_DIR) / "model").glob("*.yaml")}
HF_GROUP = "hf"  # conf/model/hf.yaml: any model folder or GGUF that model.path names
# Hydra's quoted strings: backslashes before a quote or at the end are escapes, and OmegaConf reads `${` as an
# interpolation unless escaped; everything else in the quotes is taken as it is.
_QUOTED_SPECIAL = re.compile(r"(\\*)('|\$\{|$)")
_ESCAPED = {"'": "\\'", "${": "\\${", "": ""}
_compose_lock = threading.Lock()  # Hydra composes through one global instance


@dataclass(frozen=True)
class Result:
    """A finished job: `table`, one row per input row and sample (`sample_index` with sampling.n > 1) in input
    order, with the columns of `results/*.parquet`; `stats`, the `stats/job.parquet` row; `output_dir`, where it
    all lies, or None when the job ran in a temporary folder, removed since."""

    table: pl.DataFrame
    stats: dict
    output_dir: Path | None


def run(data: object = None, /, *, progress: bool | None = None, **config: object) -> Result:
    """Run a job on `data` as `batchprefill-run` would, loading the model for this job alone (a `Runner` keeps it).

    `data`: a path (anything `data.input` takes), a polars or pandas DataFrame, a pyarrow Table, a
    `datasets.Dataset`, or a list of prompt strings (their positions are their ids); None: `data.input` as
    configured (the shipped sample by default). It is positional only, so `data={"input": ...}` is the config's
    data section. `config`: the command line's keys, dotted (`**{"sampling.max_tokens": 32}`) or nested
    (`sampling={"max_tokens": 32}`); `model` may also name a model folder or GGUF (as `model.path`).
    `progress=False` turns the progress bars off (`output.progress`). Without `output.dir` the job runs in a
    temporary folder, removed when it returns. A job-level fault raises JobError.
    """
    with _one_line_errors():
        return _run_job(data, _flat_config(config, progress), None)


def plan(data: object = None, /, *, progress: bool | None = None, **config: object) -> dict:
    """The dry run of `batchprefill-plan` on `data` (as for `run`): the `plan.parquet` row, loading no weights."""
    from batchprefill.pipeline.plan import plan_job  # pulls in torch

    with _one_line_errors(), _job(data, _flat_config(config, progress)) as job:
        return plan_job(job)


class Runner:
    """A model loaded once for many jobs: `Runner(model=..., **config).run(data, **config)`.

    The constructor takes any config key but `output.dir`; each `run` call takes `task`, `data.*`, `sampling.*` and
    `output.*` keys, over the constructor's. `model.*` and `engine.*` keys are fixed by the loaded model and raise.
    """

    def __init__(self, model: object = None, *, progress: bool | None = None, **config: object):
        from batchprefill.pipeline.build_engine import load_job_model  # pulls in torch
        from batchprefill.pipeline.prepare import open_model

        with _one_line_errors():
            self._config = _flat_config({**config, **({} if model is None else {"model": model})}, progress)
            if "output.dir" in self._config:
                raise JobError(
                    "output.dir: give it to each runner.run(...) call, not to Runner(...): jobs run into "
                    "one folder resume each other's rows"
                )
            # output.dir only for the config to resolve: loading a model writes nothing
            job = JobSettings.from_config(_composed(_overrides({**self._config, "output.dir": tempfile.gettempdir()})))
            self.model: JobModel = load_job_model(job, open_model(job.model))

    def run(self, data: object = None, /, *, progress: bool | None = None, **config: object) -> Result:
        """A job on the loaded model, as `batchprefill.run(data, **config)` with the constructor's keys under
        these."""
        with _one_line_errors():
            call = _flat_config(config, progress)
            for key in call:
                section = key.lstrip("+~").split(".")[0]
                if section not in PER_CALL_SECTIONS:
                    raise JobError(
                        f"{key}: a Runner keeps the model and engine it was made with; give "
                        f"{section}.* keys to batchprefill.Runner(...), per call only "
                        f"{', '.join(PER_CALL_SECTIONS)}"
                    )
            mine = {key: value for key, value in self._config.items() if data is None or key != "data.input"}
            return _run_job(data, {**mine, **call}, self.model)


def _run_job(data: object, config: dict[str, object], model: JobModel | None) -> Result:
    from batchprefill.pipeline.run import run_job  # pulls in torch

    with _job(data, config) as job:
        stats = run_job(job, model)
        table = results_in_input_order(job)
    return Result(table, stats, job.output.dir if "output.dir" in config else None)


@contextmanager
def _job(data: object, config: dict[str, object]) -> Iterator[JobSettings]:
    """The checked settings of a job on `data`, its output folder made (a temporary one without output.dir, removed
    afterwards) and in-memory data written there as its input."""
    given = "output.dir" in config
    with nullcontext() if given else tempfile.TemporaryDirectory(prefix="batchprefill-") as temporary:
        config = dict(config)
        if not given:  # a figure drawn in a folder removed when the job returns would be seen by no one
            config = {"output.plot": False, **config, "output.dir": temporary}
        table = None if data is None or isinstance(data, (str, os.PathLike)) else _as_table(data)
        if data is not None:
            if "data.input" in config:
                raise JobError("data.input: give the data once, as the first argument or as data.input")
            staged = Path(os.fspath(config["output.dir"])).expanduser() / STAGED_INPUT
            config["data.input"] = staged if table is not None else data
        job = checked_job(_composed(_overrides(config)))
        if not given:
            job = replace(job, output=replace(job.output, temporary=True))
        if table is not None:
            _stage(table, job)
        yield job


def _as_table(data: object) -> pa.Table | list[str]:
    """In-memory data as an Arrow table; a list of prompts stays a list until the prompt column's name is known."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pl.DataFrame):
        return data.to_arrow()
    pandas, datasets = sys.modules.get("pandas"), sys.modules.get("datasets")  # imported if `data` is theirs
    if pandas is not None and isinstance(data, pandas.DataFrame):
        return pa.Table.from_pandas(data, preserve_index=False)
    if datasets is not None and isinstance(data, datasets.Dataset):
        return data.with_format("arrow")[:]  # the rows a select or shuffle left, in their order
    if isinstance(data, (list, tuple)):
        wrong = next((i for i, prompt in enumerate(data) if not isinstance(prompt, str)), None)
        if wrong is not None:
            raise JobError(
                f"data: a list is taken as prompts, but item {wrong} is {a_type(data[wrong])}, not a string"
            )
        return list(data)
    raise JobError(
        f"data: {a_type(data)} is none of a path, a polars or pandas DataFrame, a pyarrow "
        "Table, a datasets.Dataset or a list of prompt strings"
    )


def _stage(data: pa.Table | list[str], job: JobSettings) -> None:
    """Write in-memory data where the job reads its input (data.input, in its output folder)."""
    if job.data.format != "parquet":
        raise JobError(
            f"data.format={job.data.format}: in-memory data is read as parquet; give a path to read another format"
        )
    if isinstance(data, list):
        if job.data.columns.prompt is None:
            raise JobError("data: a list of prompts has no conversations for data.messages_column; give a table")
        data = pa.table({job.data.columns.prompt: pa.array(data, pa.string())})
    pq.write_table(data, job.data.input)


def results_in_input_order(job: JobSettings) -> pl.DataFrame:
    """Every result row in the job's output folder, in input order: results are written in prefix order, so each
    row's position comes from the prepared partitions (`_bp_row` beside the id), then `sample_index`."""
    out, id_column = job.output.dir, job.data.columns.id
    parts = [read_parquet(part, None, RESUME_REMEDY) for part in sorted((out / "results").glob("part-*.parquet"))]
    if not parts:
        return pl.DataFrame()
    results = pl.from_arrow(pa.concat_tables(parts, promote_options="permissive"))
    rows = pl.from_arrow(
        pa.concat_tables(
            [
                read_parquet(part, [id_column, ROW], PARTITION_REMEDY)
                for part in sorted((out / "partitions").glob("part-*.parquet"))
            ]
        )
    )
    order = [ROW, *([SAMPLE_INDEX.name] if SAMPLE_INDEX.name in results.columns else [])]
    return results.join(rows, on=id_column, how="left").sort(order, nulls_last=True).drop(ROW)


def _flat_config(config: Mapping[str, object], progress: bool | None) -> dict[str, object]:
    """Keyword arguments as the command line's dotted keys: nested mappings flattened, `model` naming a folder or
    GGUF (not a conf/model group) taken as `model=hf model.path=...`, `progress` as output.progress."""
    flat: dict[str, object] = {}
    for key, value in _leaves(config, ""):
        if key == "model" and isinstance(value, (str, os.PathLike)) and os.fspath(value) not in MODEL_GROUPS:
            pairs = [("model", HF_GROUP), ("model.path", value)]  # as `model=hf model.path=...`
        else:
            pairs = [(key, value)]
        for name, given in pairs:
            if name in flat:
                raise JobError(f"{name} is given twice: give each key once, dotted or nested")
            flat[name] = given
    if progress is not None:
        flat["output.progress"] = progress
    return flat


def _leaves(config: Mapping[str, object], prefix: str) -> Iterator[tuple[str, object]]:
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _overrides(config: Mapping[str, object]) -> list[str]:
    """The command line's overrides; an entry of a named mapping (`model.adapters.math`) is added or replaced
    (Hydra's `++`), as a user writes `+model.adapters.math=...` for one the config lacks."""
    return [f"{'++' if _in_named_mapping(key) else ''}{key}={hydra_value(key, value)}" for key, value in config.items()]


def _in_named_mapping(key: str) -> bool:
    parent = key.rpartition(".")[0]
    return parent in KEYS and KEYS[parent].open_mapping


def hydra_value(key: str, value: object) -> str:
    """A Python value as Hydra's override grammar writes it, read back as exactly that value: strings (and paths)
    quoted, so `'a b'`, `"it's"` or `{"type": "object"}` stay strings and `${...}` is not interpolated."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Integral):
        return str(int(value))
    if isinstance(value, Real):
        return repr(float(value))
    if isinstance(value, (str, os.PathLike)):
        text = _QUOTED_SPECIAL.sub(lambda m: m.group(1) * 2 + _ESCAPED[m.group(2)], os.fspath(value))
        return f"'{text}'"
    if isinstance(value, (list, tuple)):
        return f"[{','.join(hydra_value(key, item) for item in value)}]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{hydra_value(key, str(k))}:{hydra_value(key, v)}" for k, v in value.items()) + "}"
    raise JobError(f"{key}={value!r}: give a string, number, bool, None, list or mapping")


def _composed(overrides: list[str]):
    """conf/config.yaml with these overrides, composed as the command line composes its own."""
    with _compose_lock, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        try:
            return compose("config", overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            raise config_error(error) from error


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """A fault the command line reports in one line (`cli.app.user_fault`: a JobError, a full disk) raised as that
    JobError, its message the line printed after `batchprefill: error: `; anything else, a bug, as it is."""
    try:
        yield
    except Exception as error:
        fault = user_fault(error)
        if fault is None:
            raise
        fault.args = (one_line(str(fault)),)
        if fault is error:
            raise
        raise fault from error
