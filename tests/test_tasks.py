"""Tasks are plug-ins: the registry names the tasks it has, and a task defined here, registered for this test
alone, runs a whole job through `run_job` with no other module edited."""

import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from batchprefill.cli.app import CONFIG_DIR
from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.pipeline.run import run_job
from batchprefill.settings import JobSettings
from batchprefill.tasks import TASKS, get_task
from batchprefill.tasks.generate import Generate

PROMPTS = {"a": "The capital of France is", "b": "Bees make honey and wax in their", "c": "One"}


class PromptLength(Generate):
    """Each row's prompt length in tokens as its only result column, from generate's requests."""

    name = "prompt_length"

    def result_fields(self, samples: bool, logprobs: bool) -> list[pa.Field]:
        return [pa.field("prompt_length", pa.int32())]

    def result_columns(self, request: Request) -> dict:
        return {"prompt_length": request.num_prompt_tokens}


def job_settings(*overrides: str) -> JobSettings:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return JobSettings.from_config(compose("config", overrides=list(overrides)))


def test_an_unknown_task_is_a_one_line_error_naming_the_registered_tasks(monkeypatch):
    with pytest.raises(JobError) as error:
        get_task("x")
    assert str(error.value) == "task='x': choose generate, score, embed or classify"
    monkeypatch.setitem(TASKS, PromptLength.name, PromptLength())
    with pytest.raises(JobError) as error:
        job_settings("task=rerank", "output.dir=unused")
    assert str(error.value) == "task='rerank': choose generate, score, embed, classify or prompt_length"


def test_a_task_defined_here_runs_a_job_and_writes_its_column(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setitem(TASKS, PromptLength.name, PromptLength())
    data, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": list(PROMPTS), "prompt": list(PROMPTS.values())}), data)
    job = job_settings("task=prompt_length", f"data.input={data}", f"output.dir={out}", "sampling.max_tokens=1",
                       "engine.kv_cache_tokens=1024", "output.progress=false", "output.plot=false")
    sigterm = signal.getsignal(signal.SIGTERM)  # the run traps SIGTERM to commit what finished: give it back
    try:
        stats = run_job(job)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    table = pq.read_table(out / "results")
    assert table.column_names == ["id", "prompt", "prompt_length"]
    lengths = {key: len(ids) for key, ids in zip(PROMPTS, tokenizer.encode_batch(list(PROMPTS.values())))}
    assert dict(zip(table["id"].to_pylist(), table["prompt_length"].to_pylist())) == lengths
    assert stats["num_requests"] == len(PROMPTS) and stats["num_errors"] == 0
