"""The console script as users run it, checked against the contract in INTERFACE.md."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset

from tests.conftest import REPO, run_cli
from tests.test_plan import PNG_SIGNATURE

FAST = ["sampling.max_tokens=6", "engine.kv_cache_tokens=4096", "output.progress=false"]
RESULT_TYPES = {
    "output_text": pa.string(), "output_token_ids": pa.list_(pa.int32()), "num_prompt_tokens": pa.int32(),
    "num_cached_tokens": pa.int32(), "finish_reason": pa.string(), "error": pa.string(),
}
JOB_COLUMNS = {"num_requests", "num_errors", "prompt_tokens", "cached_tokens", "computed_prompt_tokens",
               "output_tokens", "wall_seconds", "prefill_tokens_per_second", "output_tokens_per_second",
               "cache_hit_rate", "evicted_blocks", "preemptions", "active_blocks", "reclaimable_blocks",
               "free_blocks", "ideal_cached_tokens", "max_batched_tokens", "prepare_seconds", "load_seconds",
               "warm_up_seconds"}


def run_job(out, *overrides: str):
    return run_cli(["batchprefill-run", f"output.dir={out}", *FAST, *overrides])


def results(out) -> pa.Table:
    return pq.read_table(out / "results")


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    done = run_job(out)
    assert done.returncode == 0, done.stderr
    return out, done


def test_sample_job_writes_every_file_of_the_contract(sample_run):
    out, done = sample_run
    source = pq.read_table(REPO / "data_samples" / "prompts.parquet")
    table = results(out)
    assert table.num_rows == source.num_rows
    assert sorted(table["id"].to_pylist()) == sorted(source["id"].to_pylist())
    assert table.column_names[: len(source.column_names)] == source.column_names
    for name, kind in RESULT_TYPES.items():
        assert table.schema.field(name).type == kind
    by_id = {row["id"]: row for row in table.to_pylist()}
    for row in source.to_pylist():  # input columns unchanged
        assert all(by_id[row["id"]][k] == v for k, v in row.items())
    errors = [r for r in by_id.values() if r["finish_reason"] == "error"]
    assert len(errors) == 3 and all(r["error"] and r["output_text"] == "" for r in errors)
    good = [r for r in by_id.values() if r["finish_reason"] != "error"]
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") for r in good)
    assert all(1 <= len(r["output_token_ids"]) <= 6 for r in good)
    assert sum(r["num_cached_tokens"] > 0 for r in good) >= 40  # the sample shares system prompts
    assert not list(out.rglob("*.tmp"))

    job = pq.read_table(out / "stats" / "job.parquet").to_pylist()
    assert len(job) == 1 and set(job[0]) >= JOB_COLUMNS
    job = job[0]
    assert job["num_requests"] == source.num_rows and job["num_errors"] == 3
    assert job["prompt_tokens"] == sum(r["num_prompt_tokens"] for r in good)
    assert job["cached_tokens"] == sum(r["num_cached_tokens"] for r in good)
    assert job["computed_prompt_tokens"] == job["prompt_tokens"] - job["cached_tokens"]
    assert job["cache_hit_rate"] == pytest.approx(job["cached_tokens"] / job["prompt_tokens"])
    # A CPU compiles no kernels: the start-up is preparing the input and loading, both inside the job's time.
    assert job["prepare_seconds"] > 0 and job["load_seconds"] > 0 and job["warm_up_seconds"] == 0
    assert job["prepare_seconds"] + job["load_seconds"] < job["wall_seconds"]

    groups = pq.read_table(out / "stats" / "groups.parquet")
    assert sum(groups["num_requests"].to_pylist()) == len(good)
    assert sum(groups["cached_tokens"].to_pylist()) == job["cached_tokens"]
    steps = pq.read_table(out / "stats" / "steps.parquet")
    assert {"step", "num_decode_tokens", "num_prefill_tokens", "num_seqs", "active_blocks", "reclaimable_blocks",
            "free_blocks", "duration_ms"} <= set(steps.column_names)
    assert sum(steps["num_prefill_tokens"].to_pylist()) == job["computed_prompt_tokens"]
    assert all(a + r + f == 256 for a, r, f in zip(steps["active_blocks"].to_pylist(),
                        steps["reclaimable_blocks"].to_pylist(), steps["free_blocks"].to_pylist()))
    last = steps.slice(steps.num_rows - 1).to_pylist()[0]  # running totals end at the job's
    assert (last["finished_prompt_tokens"], last["finished_cached_tokens"]) == (job["prompt_tokens"],
                                                                               job["cached_tokens"])
    assert (last["evicted_blocks"], last["preemptions"]) == (job["evicted_blocks"], job["preemptions"])
    assert 0 < job["cached_tokens"] <= job["ideal_cached_tokens"] < job["prompt_tokens"]
    assert job["max_batched_tokens"] == 2048
    assert "prefix cache" in done.stderr  # the closing summary
    assert (out / "stats" / "run.png").read_bytes().startswith(PNG_SIGNATURE)
    assert f"the run at a glance: {out / 'stats' / 'run.png'}" in done.stderr


def test_rerun_into_the_same_folder_resumes_and_adds_nothing(sample_run):
    out, _ = sample_run
    before = results(out).num_rows
    again = run_job(out)
    assert again.returncode == 0, again.stderr
    assert results(out).num_rows == before
    assert pq.read_table(out / "stats" / "steps.parquet").num_rows == 0
    assert "the run at a glance" in again.stderr  # a run with no step to draw still gets its figure


def test_input_order_computes_more_than_prefix_order(sample_run, tmp_path):
    prefix_out, _ = sample_run
    done = run_job(tmp_path, "data.order=input", "engine.prefix_caching=false")
    assert done.returncode == 0, done.stderr
    prefix = pq.read_table(prefix_out / "stats" / "job.parquet")["computed_prompt_tokens"][0].as_py()
    baseline = pq.read_table(tmp_path / "stats" / "job.parquet").to_pylist()[0]
    assert baseline["cached_tokens"] == 0 and baseline["computed_prompt_tokens"] > 2 * prefix


def test_namespaces_never_share_cached_blocks_and_ids_default_to_positions(tmp_path):
    prompt = "You are a meticulous assistant. " * 8 + "Say hi."
    pq.write_table(pa.table({"prompt": [prompt, prompt, prompt], "tenant": ["a", "b", "a"]}), tmp_path / "in.parquet")
    done = run_job(tmp_path / "out", f"data.input={tmp_path / 'in.parquet'}", "data.namespace_column=tenant")
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in results(tmp_path / "out").to_pylist()}
    assert set(rows) == {0, 1, 2}
    assert rows[1]["num_cached_tokens"] == 0  # tenant b shares nothing with tenant a
    assert max(rows[0]["num_cached_tokens"], rows[2]["num_cached_tokens"]) > 0


def test_a_saved_hf_dataset_is_read(tmp_path):
    Dataset.from_dict({"id": ["x", "y"], "text": ["What is 2+2?", None]}).save_to_disk(str(tmp_path / "ds"))
    done = run_job(tmp_path / "out", f"data.input={tmp_path / 'ds'}", "data.format=datasets",
                   "data.prompt_column=text", "data.chat_template=true")
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in results(tmp_path / "out").to_pylist()}
    assert rows["x"]["finish_reason"] in ("stop", "length") and rows["x"]["num_prompt_tokens"] > 20
    assert rows["y"]["finish_reason"] == "error" and "null" in rows["y"]["error"]


@pytest.mark.parametrize("overrides, says", [
    (["data.input=/nonexistent/file.parquet"], "data.input"),
    (["data.prompt_column=question"], "data.prompt_column"),
    (["model.path=/nonexistent/model"], "model.path"),
    (["engine.block_size=3"], "engine.block_size"),
    (["sampling.top_p=0"], "sampling.top_p"),
    (["data.order=random"], "data.order"),
])
def test_job_level_faults_exit_non_zero_with_one_line(tmp_path, overrides, says):
    done = run_job(tmp_path, *overrides)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("batchprefill: error:")
    assert not (tmp_path / "results").exists()


def test_an_explicit_pool_is_capped_at_what_the_job_can_use(model_folder):
    import torch

    from batchprefill.engine.kv_cache import pool_blocks
    from batchprefill.model.families import read_config

    model = read_config(model_folder)
    cpu = torch.device("cpu")
    # 1,000 tokens of prompts and outputs: 63 blocks, plus one partial block per sequence that may run at once
    assert pool_blocks(model, torch.float32, cpu, 16, 8, requested_tokens=1_000_000, tokens_needed=1000) == 63 + 8
    # below the need: taken as given
    assert pool_blocks(model, torch.float32, cpu, 16, 8, requested_tokens=320, tokens_needed=1000) == 20

