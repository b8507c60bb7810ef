"""A rerun into an output.dir that holds results continues only the job that wrote them (pipeline/job_record.py):
after a change to the input rows, the model, the adapters, the task or a sampling key it refuses in one line
naming what changed, before any weight is loaded, and never returns the earlier rows as if they were this job's.
The same job written again (in-memory data staged anew, the input file rewritten with the same rows) resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchprefill
import batchprefill.pipeline.build_engine
from batchprefill import JobError

PROMPTS = ["The capital of France is", "Two plus two is", "The largest planet is"]
FAST = {"sampling.max_tokens": 2, "engine.kv_cache_tokens": 1024, "output.plot": False, "output.progress": False}
REMEDY = "to start over, delete"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, batchprefill.api.Result]:
    """One real job of 3 rows into an explicit output.dir, from a file."""
    folder = tmp_path_factory.mktemp("first")
    data = folder / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    result = batchprefill.run(data, output={"dir": str(folder / "out")}, **FAST)
    assert result.stats["num_requests"] == 3
    return data, result


@pytest.fixture
def copied(first_run, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A copy of the first run's input and output folder to rerun into; any weight load fails the test."""
    data, result = first_run
    shutil.copy2(data, tmp_path / data.name)
    shutil.copytree(result.output_dir, tmp_path / "out")

    def no_load(*args, **kwargs):
        raise AssertionError("a refused resume loaded the model")

    monkeypatch.setattr(batchprefill.pipeline.build_engine, "load_model", no_load)
    return tmp_path / data.name, tmp_path / "out"


def refused(data, out: Path, **config) -> str:
    before = sorted(path.name for path in (out / "results").iterdir())
    with pytest.raises(JobError) as raised:
        batchprefill.run(data, output={"dir": str(out)}, **{**FAST, **config})
    assert sorted(path.name for path in (out / "results").iterdir()) == before  # nothing written, nothing lost
    line = str(raised.value)
    assert line.startswith(f"output.dir={out} holds results of another job (") and REMEDY in line, line
    return line


def test_other_prompts_under_the_same_3_ids_are_refused_as_a_changed_input(copied):
    data, out = copied
    pq.write_table(pa.table({"prompt": ["Roses are", "The sky is", "One and one make"]}), data)
    assert "the input's rows changed (data.input)" in refused(data, out)


def test_a_changed_row_in_memory_is_refused_too(copied):
    _, out = copied
    assert "the input's rows changed (data.input)" in refused([*PROMPTS[:2], "Roses are"], out)


def test_another_model_folder_with_the_same_tokenizer_is_refused_as_a_changed_model(copied, model_folder, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    for file in model_folder.iterdir():
        (other / file.name).symlink_to(file)
    (other / "config.json").unlink()
    config = json.loads((model_folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    data, out = copied
    assert "the model's files changed (model.path)" in refused(data, out, model=str(other))


def test_an_added_adapter_is_refused_as_changed_adapters(copied, tmp_path):
    data, out = copied
    line = refused(data, out, model={"adapters": {"math": str(tmp_path / "lora")}})
    assert "the adapters (names or files) changed (model.adapters)" in line


def test_another_task_is_refused_naming_both(copied):
    data, out = copied
    assert 'task changed: "generate" -> "embed"' in refused(data, out, task="embed")


@pytest.mark.parametrize(("key", "value", "words"), [
    ("sampling.temperature", 0.7, "sampling.temperature changed: 0.0 -> 0.7"),
    ("sampling.max_tokens", 3, "sampling.max_tokens changed: 2 -> 3"),
    ("sampling.stop", ["."], 'sampling.stop changed: [] -> ["."]'),
    ("sampling.choice", ["yes", "no"], "sampling.json_schema, sampling.regex or sampling.choice changed"),
    ("data.chat_template", True, "data.chat_template changed: false -> true"),
])
def test_a_changed_sampling_key_is_refused_with_its_values(copied, key, value, words):
    data, out = copied
    assert words in refused(data, out, **{key: value})


def test_the_same_rows_written_again_resume_with_nothing_to_run(first_run, tmp_path):
    data, result = first_run
    out = tmp_path / "out"
    shutil.copytree(result.output_dir, out)
    pq.write_table(pa.table({"prompt": PROMPTS}), data)  # the same rows, a new file: the partitions are made again
    again = batchprefill.run(data, output={"dir": str(out)}, **FAST, **{"engine.max_num_seqs": 2})
    assert again.stats["num_requests"] == 0  # a batching key is not part of the job: the rows stand
    assert again.table.to_dicts() == result.table.to_dicts()
