"""The job on a real single-node Slurm: a job array plus a merge that waits for it, and a task requeued part-way.

The cluster is started here (installing Debian's Slurm when missing); if it cannot start, these tests fail.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.slurm_cluster import REPO, SlurmCluster
from tests.test_resume import FAST, SLOW, assert_same_outputs, input_ids, make_prompts, results_by_id, wait_for_part

pytestmark = pytest.mark.slurm
JOB_TIMEOUT = 300


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


def logs(out: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(out.rglob("*.out")))


def test_array_of_three_then_merge(slurm, tmp_path):
    # ~1 MB of input at data.buffer_mb=1 makes 4 partitions: the 3 tasks each get whole prefix groups.
    data = make_prompts(tmp_path / "prompts.parquet", pad_bytes=1_000_000)
    out = tmp_path / "out"
    submitted = subprocess.run(
        ["bash", str(REPO / "jobs" / "submit.sh"), "3", str(out), f"data.input={data}", "data.buffer_mb=1",
         "sampling.max_tokens=4", *FAST],
        env=slurm.env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    ids = dict(line.split("=") for line in submitted.stdout.split())
    states = slurm.wait([ids["array_job_id"], ids["merge_job_id"]], JOB_TIMEOUT)
    assert len(states) == 4 and set(states.values()) == {"COMPLETED"}, f"{states}\n{logs(out)}"

    manifest = json.loads((out / "partitions" / "manifest.json").read_text())
    assert sum(rows > 0 for rows in manifest["partition_rows"]) >= 3
    shard_jobs = [pq.read_table(f / "job.parquet").to_pylist()[0] for f in sorted((out / "stats").glob("shard-*"))]
    assert len(shard_jobs) == 3 and sum(job["num_requests"] > 0 for job in shard_jobs) >= 2

    results = results_by_id(out)
    assert sorted(results) == sorted(input_ids(data))
    job = pq.read_table(out / "stats" / "job.parquet").to_pylist()[0]
    assert job["num_requests"] == len(results) and job["num_shards"] == 3
    assert pq.read_table(out / "stats" / "groups.parquet").num_rows == 8  # 8 system prompts: 8 prefix groups
    assert set(pq.read_table(out / "stats" / "steps.parquet")["shard"].to_pylist()) <= {0, 1, 2}


def test_requeued_task_resumes_to_the_same_outputs(slurm, tmp_path):
    data = make_prompts(tmp_path / "prompts.parquet")
    reference = tmp_path / "reference"
    out = tmp_path / "out"
    out.mkdir()
    overrides = [f"data.input={data}", *FAST, *SLOW]
    # The uninterrupted run, on the other core while Slurm runs the job.
    uninterrupted = subprocess.Popen(["batchprefill-run", f"output.dir={reference}", *overrides], env=slurm.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    job_id = slurm.sbatch("--requeue", f"--output={out}/slurm.out", str(REPO / "jobs" / "array.sbatch"),
                          f"output.dir={out}", *overrides, cwd=tmp_path)
    wait_for_part(out)
    slurm.call("scontrol", "requeue", job_id)
    states = slurm.wait([job_id], JOB_TIMEOUT)
    _, stderr = uninterrupted.communicate(timeout=JOB_TIMEOUT)
    assert uninterrupted.returncode == 0, stderr[-2000:]

    assert states == {job_id: "COMPLETED"}, logs(out)
    assert slurm.show(job_id)["Restarts"] == "1"
    log = (out / "slurm.out").read_text()
    assert "stopped by SIGTERM" in log, log
    writers = {part.name.rsplit("-", 1)[0] for part in (out / "results").glob("part-*.parquet")}
    assert len(writers) == 2, "expected parts from the interrupted run and from the requeued one"
    assert_same_outputs(out, reference, data)
