"""A job killed part-way (SIGKILL) or stopped (SIGTERM) and rerun into the same folder ends with every input row
exactly once and, under greedy decoding, the same outputs as a run that was never interrupted."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli

SUBJECTS = ["rivers", "volcanoes", "honey bees", "telescopes", "glaciers", "deserts", "comets", "forests"]
QUESTIONS = ["What is it?", "Where is it found?", "Why does it matter?"]
# Small and slow enough to interrupt: two sequences at a time, each 16 tokens, committed two rows per part.
SLOW = ["sampling.max_tokens=16", "engine.max_num_seqs=2", "output.commit_every_rows=2"]
FAST = ["engine.device=cpu", "engine.num_threads=1", "engine.kv_cache_tokens=2048", "output.progress=false"]


def make_prompts(path: Path, pad_bytes: int = 0) -> Path:
    """8 system prompts x 3 questions: 8 prefix groups. `pad_bytes` of random bytes (an extra column) make the
    file large enough that a small `data.buffer_mb` splits it into several partitions."""
    rng = random.Random(0)
    rows = []
    for subject in SUBJECTS:
        system = f"You are an expert on {subject}. Answer in one short sentence, plainly, for a curious child."
        for question in QUESTIONS:
            rows.append({"id": f"row-{len(rows):03d}", "prompt": f"{system}\nQuestion: {question}\nAnswer:",
                         "pad": rng.randbytes(pad_bytes // (len(SUBJECTS) * len(QUESTIONS)))})
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none")
    return path


def input_ids(path: Path) -> list[str]:
    return pq.read_table(path, columns=["id"])["id"].to_pylist()


def results_by_id(out: Path) -> dict[str, dict]:
    """Every committed result row by id; fails on a row written twice."""
    rows = [row for part in sorted((out / "results").glob("part-*.parquet"))
            for row in pq.read_table(part, columns=["id", "output_token_ids", "output_text", "finish_reason",
                                                    "error"]).to_pylist()]
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} rows written more than once"
    return {row["id"]: row for row in rows}


def assert_same_outputs(out: Path, reference: Path, data: Path) -> None:
    got, want = results_by_id(out), results_by_id(reference)
    assert sorted(got) == sorted(input_ids(data))
    differ = [i for i in want if got[i]["output_token_ids"] != want[i]["output_token_ids"]]
    assert not differ, f"outputs differ from the uninterrupted run for {differ}"
    assert all(row["error"] is None for row in got.values())


def start_job(data: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([str(Path(sys.executable).parent / "batchprefill-run"), f"data.input={data}",
                             f"output.dir={out}", *FAST, *SLOW], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_part(out: Path, job: subprocess.Popen | None = None, timeout: float = 300) -> None:
    """Until the job under `out` has committed a result part (and `job`, when given, is still running)."""
    deadline = time.monotonic() + timeout
    while not any((out / "results").glob("part-*.parquet")):
        if job is not None and job.poll() is not None:
            pytest.fail(f"the job ended before committing a part: {job.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, "no result part appeared"
        time.sleep(0.05)


def rerun(data: Path, out: Path) -> None:
    done = run_cli(["batchprefill-run", f"data.input={data}", f"output.dir={out}", *FAST, *SLOW])
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The same job, never interrupted."""
    out = tmp_path_factory.mktemp("reference")
    rerun(data, out)
    return out


def test_sigkill_then_rerun_gives_each_row_once_and_same_outputs(data, reference, tmp_path):
    job = start_job(data, tmp_path)
    wait_for_part(tmp_path, job)
    job.kill()
    job.communicate()
    assert 0 < len(results_by_id(tmp_path)) < len(input_ids(data)), "the kill did not land part-way"
    rerun(data, tmp_path)
    assert_same_outputs(tmp_path, reference, data)


def test_sigterm_commits_what_finished_and_exits_143(data, reference, tmp_path):
    job = start_job(data, tmp_path)
    wait_for_part(tmp_path, job)
    job.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 143, stderr[-2000:]
    assert time.monotonic() - sent < 20, "the job took too long to stop after SIGTERM"
    assert "stopped by SIGTERM" in stderr
    committed = len(results_by_id(tmp_path))
    assert 0 < committed < len(input_ids(data))
    rerun(data, tmp_path)
    assert_same_outputs(tmp_path, reference, data)


def test_resume_false_into_a_folder_with_results_is_one_line_error(data, reference):
    done = run_cli(["batchprefill-run", f"data.input={data}", f"output.dir={reference}", *FAST, *SLOW,
                    "output.resume=false"])
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "output.resume=false" in lines[0], done.stderr


def test_merge_checks_every_row_once_and_names_what_to_rerun(reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    merged = run_cli(["batchprefill-merge", f"output.dir={out}"])
    assert merged.returncode == 0 and "one shard" in merged.stderr, merged.stderr

    parts = sorted((out / "results").glob("part-*.parquet"))
    lost = pq.read_table(parts[0], columns=["id"])["id"].to_pylist()
    parts[0].unlink()
    shutil.copy(parts[1], out / "results" / "part-0000-copy-00000.parquet")
    merged = run_cli(["batchprefill-merge", f"output.dir={out}"])
    assert merged.returncode == 1
    lines = merged.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{len(lost)} of 24 rows have no result" in lines[0] and lost[0] in lines[0]
    assert "more than one result" in lines[0] and "rerun shard(s) 0 of 1" in lines[0]
