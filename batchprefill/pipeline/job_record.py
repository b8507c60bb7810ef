"""What a row's result depends on, recorded beside the results (`output.dir/job.json`), so a resume continues only
the job that wrote them.

A rerun into the same `output.dir` skips the rows already committed. That is right only when those rows are what
this run would write: the same input rows, model (weights, dtype, KV cache dtype), adapters, task, sampling
settings and prompt columns. The first run to commit results records these; a later run compares its own with
them and, if any differs, refuses in one line that names what changed and how to start over, rather than return
old rows beside new ones. Settings that change how rows are batched, not what a row is (data.order, engine.*
sizes, shards), are not recorded: a resume may change them.

The input is recorded by its content (the digest preparing takes of every row, `Manifest.input_digest`), not by
its files' dates, so a file written again with the same rows (the Python API stages in-memory data anew on each
call) resumes, and other prompts under the same ids do not.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from batchprefill.errors import JobError
from batchprefill.io.atomic import replace_atomic
from batchprefill.model.adapters import CONFIG_FILE, WEIGHTS_FILE, adapter_identity
from batchprefill.pipeline.prepare import Prepared
from batchprefill.settings import JobSettings

RECORD_NAME = "job.json"


def job_record(job: JobSettings, prepared: Prepared) -> dict[str, object]:
    """Every setting a row's result depends on, by the config key a user changes, as JSON values."""
    columns = job.data.columns
    sampling = {f"sampling.{name}": value for name, value in asdict(job.sampling).items() if name != "constraint"}
    constraint = job.sampling.constraint
    return {
        "data.input": prepared.manifest.input_digest,
        "model.path": prepared.model.identity,
        "model.dtype": job.model.dtype,
        "engine.kv_cache_dtype": job.engine.kv_cache_dtype,
        "model.adapters": {name: _adapter_identity(Path(folder)) for name, folder in job.model.adapters.items()},
        "model.pooling": [job.model.pooling.kind, job.model.pooling.normalize] if job.task == "embed" else None,
        "task": job.task,
        **{key: list(value) if isinstance(value, tuple) else value for key, value in sampling.items()},
        "sampling.json_schema, sampling.regex or sampling.choice":
            None if constraint is None else [constraint.kind, constraint.spec],
        "data.chat_template": job.data.chat_template,
        "data.*_column": json.loads(json.dumps(asdict(columns), default=list)),
    }


def check_same_job(job: JobSettings, prepared: Prepared, results_dir: Path) -> None:
    """Records this job beside results it starts; refuses in one line to continue results another job wrote."""
    record, path = job_record(job, prepared), job.output.dir / RECORD_NAME
    if not any(results_dir.glob("part-*.parquet")) or not path.exists():  # a new job (or results of an old version)
        # the shards of an array starting at once write the same record, each through its own staging file
        replace_atomic(path, lambda staging: staging.write_text(json.dumps(record, indent=1, sort_keys=True)))
        return
    earlier = json.loads(path.read_text())
    changed = [_change(key, earlier.get(key), value) for key, value in record.items() if earlier.get(key) != value]
    if changed:
        raise JobError(f"output.dir={job.output.dir} holds results of another job ({'; '.join(changed)}): its rows "
                       f"would be stale; to start over, delete {results_dir} (or choose another output.dir), or "
                       "rerun the job as it was to resume it")


def _change(key: str, before: object, now: object) -> str:
    """One changed setting in words: the value before and now when short, else that it changed."""
    if key in ("data.input", "model.path", "model.adapters"):
        what = {"data.input": "the input's rows", "model.path": "the model's files",
                "model.adapters": "the adapters (names or files)"}[key]
        return f"{what} changed ({key})"
    shown = [json.dumps(value) for value in (before, now)]
    if max(map(len, shown)) > 40:
        return f"{key} changed"
    return f"{key} changed: {shown[0]} -> {shown[1]}"


def _adapter_identity(folder: Path) -> str | None:
    """The adapter's fingerprint (its config and weights), None for a folder without them: the engine refuses it
    when it loads the adapters, before any row runs."""
    return adapter_identity(folder) if (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file() else None
