"""stats/run.png: drawn after a run and after a merge, cheap for a million steps, never a reason for a job to fail.

The sample run's figure is checked in test_job.py (on the run that file already makes); here a two-shard job and
its merge, and synthetic statistics for what a real run here is too small to reach.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchprefill.report.run_figure import MAX_STEP_POINTS, bin_steps, draw_run, write_run_figure
from tests.conftest import run_cli
from tests.test_plan import PNG_SIGNATURE
from tests.test_resume import FAST, make_prompts

SHARDS = ["data.num_shards=2", "sampling.max_tokens=4", *FAST]


def job_row(**values: int | float) -> dict:
    row = {"num_requests": 0, "num_errors": 0, "prompt_tokens": 0, "cached_tokens": 0, "cache_hit_rate": 0.0,
           "wall_seconds": 0.0, "ideal_cached_tokens": 0, "max_batched_tokens": 2048}
    return {**row, **values}


def synthetic_stats(folder: Path, num_steps: int, num_groups: int) -> Path:
    """A stats folder as a long run would leave it: every column the figure reads, with plausible values."""
    step = np.arange(num_steps)
    decode = step % 256
    pool = 4096
    active = (step * 7) % pool
    reclaimable = (pool - active) // 2
    finished_prompt = step * 300
    steps = pa.table({
        "step": step, "num_decode_tokens": decode, "num_prefill_tokens": 2048 - decode,
        "num_seqs": decode + 1, "active_blocks": active, "reclaimable_blocks": reclaimable,
        "free_blocks": pool - active - reclaimable, "duration_ms": 20.0 + step % 5,
        "evicted_blocks": step // 1000, "preemptions": step // 250_000, "finished_prompt_tokens": finished_prompt,
        "finished_cached_tokens": finished_prompt * 3 // 4,
    })
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(steps, folder / "steps.parquet")
    sizes = 1 + np.arange(num_groups) % 300
    groups = pa.table({"group_id": np.arange(num_groups), "num_requests": sizes,
                       "shared_prefix_tokens": np.full(num_groups, 64), "prompt_tokens": sizes * 400,
                       "cached_tokens": (sizes - 1) * 300, "computed_prompt_tokens": sizes * 100 + 300})
    pq.write_table(groups, folder / "groups.parquet")
    prompt = int(finished_prompt[-1])
    pq.write_table(pa.Table.from_pylist([job_row(num_requests=num_steps, prompt_tokens=prompt,
                                                 cached_tokens=prompt * 3 // 4, cache_hit_rate=0.75,
                                                 wall_seconds=num_steps * 0.02, ideal_cached_tokens=prompt * 4 // 5)]),
                   folder / "job.parquet")
    return folder


def test_two_shards_running_totals_carry_across_the_boundary_so_5_blocks_were_evicted_in_all():
    # shard 0 evicts 2 blocks at its step 1; shard 1 evicts 1 block at its step 0 and 2 more at its step 2
    steps = pa.table({"evicted_blocks": [0, 2, 2, 1, 1, 3], "shard": pa.array([0, 0, 0, 1, 1, 1], pa.int32())})
    bins = bin_steps(steps)
    assert bins.width == 1 and bins.shard_starts.tolist() == [3]
    assert bins.total["evicted_blocks"].tolist() == [0, 2, 2, 3, 3, 5]
    assert bins.happened["evicted_blocks"].tolist() == [False, True, False, True, False, True]


def test_a_million_steps_average_into_2000_bins_of_500_steps():
    count = 1_000_000
    steps = pa.table({"num_decode_tokens": np.arange(count) % 10, "preemptions": np.arange(count) // 400_000})
    bins = bin_steps(steps)
    assert MAX_STEP_POINTS == 2000 and bins.width == 500 and bins.first_step.size == 2000
    assert bins.first_step[:3].tolist() == [0, 500, 1000]
    assert np.allclose(bins.mean["num_decode_tokens"], 4.5)  # 0..9, fifty times over, in every bin
    assert bins.total["preemptions"][-1] == 2 and np.flatnonzero(bins.happened["preemptions"]).tolist() == [800, 1600]


def test_a_million_step_run_with_100k_groups_draws_in_under_20_seconds(tmp_path):
    stats = synthetic_stats(tmp_path / "stats", num_steps=1_000_000, num_groups=100_000)
    started = time.perf_counter()
    assert write_run_figure(stats, "batchprefill") == stats / "run.png"
    assert time.perf_counter() - started < 20
    assert (stats / "run.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_run_with_no_steps_and_no_groups_still_draws(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    pq.write_table(pa.Table.from_pylist([job_row(num_requests=3, num_errors=3)]), stats / "job.parquet")
    pq.write_table(pa.Table.from_pylist([]), stats / "steps.parquet")  # what a run with nothing to do writes
    pq.write_table(pa.Table.from_pylist([]), stats / "groups.parquet")
    draw_run(stats, stats / "run.png")
    assert (stats / "run.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_broken_steps_table_is_one_warning_line_and_no_figure(tmp_path, capsys):
    stats = synthetic_stats(tmp_path / "stats", num_steps=100, num_groups=10)
    (stats / "steps.parquet").write_bytes(b"not parquet")
    assert write_run_figure(stats, "batchprefill-merge") is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchprefill-merge: warning: could not draw")
    assert not list(stats.glob("*.png")) and not list(stats.glob(".*.tmp"))


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory) -> tuple[Path, list]:
    """24 prompts in 8 prefix groups run as two shards: shard 0 with output.plot=false, and shard 1 into a stats
    folder where run.png cannot be written (a folder holds its name)."""
    root = tmp_path_factory.mktemp("two_shards")
    data = make_prompts(root / "prompts.parquet")
    out = root / "out"
    (out / "stats" / "shard-0001-of-0002" / "run.png").mkdir(parents=True)
    runs = [run_cli(["batchprefill-run", f"data.input={data}", f"output.dir={out}", *SHARDS, "data.shard_index=0",
                     "output.plot=false"]),
            run_cli(["batchprefill-run", f"data.input={data}", f"output.dir={out}", *SHARDS, "data.shard_index=1"])]
    for done in runs:
        assert done.returncode == 0, done.stderr
    return out, runs


def test_output_plot_false_draws_nothing_for_a_run_or_a_merge(two_shards):
    out, runs = two_shards
    assert not (out / "stats" / "shard-0000-of-0002" / "run.png").exists()
    assert "at a glance" not in runs[0].stderr
    (out / "stats" / "run.png").unlink(missing_ok=True)
    merged = run_cli(["batchprefill-merge", f"output.dir={out}", "output.plot=false"])
    assert merged.returncode == 0, merged.stderr
    assert (out / "stats" / "job.parquet").exists() and not (out / "stats" / "run.png").exists()
    assert "at a glance" not in merged.stderr


def test_a_figure_that_cannot_be_written_is_one_warning_and_the_shard_still_succeeds(two_shards):
    out, runs = two_shards
    shard = out / "stats" / "shard-0001-of-0002"
    warnings = [line for line in runs[1].stderr.splitlines() if line.startswith("batchprefill: warning")]
    assert len(warnings) == 1 and warnings[0].startswith(f"batchprefill: warning: could not draw {shard / 'run.png'}")
    assert "at a glance" not in runs[1].stderr
    job = pq.read_table(shard / "job.parquet").to_pylist()[0]
    assert job["num_requests"] > 0 and (shard / "steps.parquet").exists()


def test_the_merge_draws_the_whole_array_and_sums_the_ideal_of_both_shards(two_shards):
    out, _ = two_shards
    merged = run_cli(["batchprefill-merge", f"output.dir={out}"])
    assert merged.returncode == 0, merged.stderr
    assert f"the run at a glance: {out / 'stats' / 'run.png'}" in merged.stderr
    assert (out / "stats" / "run.png").read_bytes().startswith(PNG_SIGNATURE)

    shards = [pq.read_table(f / "job.parquet").to_pylist()[0] for f in sorted((out / "stats").glob("shard-*"))]
    assert len(shards) == 2 and all(s["num_requests"] > 0 for s in shards)  # both shards ran requests
    job = pq.read_table(out / "stats" / "job.parquet").to_pylist()[0]
    assert job["ideal_cached_tokens"] == sum(s["ideal_cached_tokens"] for s in shards)
    assert job["max_batched_tokens"] == 2048
    # the ideal is the plan's arithmetic: what the plan of the same job says need not be computed
    plan = run_cli(["batchprefill-plan", f"data.input={out.parent / 'prompts.parquet'}", f"output.dir={out}",
                    *SHARDS, "data.shard_index=0"])
    assert plan.returncode == 0, plan.stderr
    planned = pq.read_table(out / "plan.parquet").to_pylist()[0]
    assert planned["prompt_tokens"] == job["prompt_tokens"]
    assert planned["prompt_tokens"] - planned["ideal_computed_tokens"] == job["ideal_cached_tokens"]
