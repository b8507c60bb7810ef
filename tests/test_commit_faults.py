"""Two runs of one shard at once, a crash at any point of a part's commit, a full disk, and what a crashed run
leaves: each ends with every id exactly once and the outputs of a run that never failed.

The kills are real: a job run with BATCHPREFILL_TEST_KILL_AT=POINT:GLOB SIGKILLs itself at that point of committing
the matching part. The full disks are real too: a tmpfs of a few hundred KiB mounted for the test (root, as in CI).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchprefill.cli.app import reported_errors
from batchprefill.errors import DiskFull
from batchprefill.io import atomic
from batchprefill.io.atomic import KILL_AT_ENV, write_records
from batchprefill.report.stats import JobTotals, write_stats
from tests.conftest import REPO, run_cli
from tests.test_resume import assert_same_outputs, input_ids, make_prompts, results_by_id
from tests.test_sole_writer import job_args, lease_path

KILL_POINTS = ["written", "flushed", "renamed", "synced"]  # data written, flushed, renamed, the rename flushed


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `folder`, unmounted afterwards; mounting needs root, which CI has."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    assert mounted.returncode == 0, f"mounting a tmpfs needs root (CI runs as root): {mounted.stderr}"
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(disk: Path) -> None:
    """Leave no byte free on `disk`."""
    with open(disk / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC


def leftovers(out: Path) -> list[Path]:
    """Staging files a reader might trip over, anywhere a run writes."""
    return [path for folder in (out / "results", out / "stats") if folder.exists()
            for path in folder.rglob("*.tmp")]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet")


def start(data: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]), **(env or {})}
    return subprocess.Popen(job_args(data, out), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def twice_at_once(data, tmp_path_factory) -> tuple[Path, list[tuple[subprocess.Popen, str]]]:
    """The same job submitted twice at once into one output.dir; the run that finished is the reference."""
    out = tmp_path_factory.mktemp("reference")
    jobs = [start(data, out) for _ in range(2)]
    return out, sorted(((job, job.communicate(timeout=300)[1]) for job in jobs), key=lambda done: done[0].returncode)


@pytest.fixture(scope="module")
def reference(twice_at_once) -> Path:
    """The job, never interrupted."""
    out, [(finished, stderr), _] = twice_at_once
    assert finished.returncode == 0, stderr[-2000:]
    return out


# --- two runs of one shard at once -------------------------------------------------------------------------------


def test_two_identical_runs_at_once_one_exits_2_naming_the_other_and_every_id_is_written_once(data, twice_at_once):
    out, [(winner, _), (refused, stderr)] = twice_at_once
    assert (winner.returncode, refused.returncode) == (0, 2), stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"output.dir={out} shard 0 of 1 is being written by another live run: host " \
        f"{socket.gethostname()}, process {winner.pid}, since " in lines[0], stderr
    assert sorted(results_by_id(out)) == sorted(input_ids(data))


# --- a crash mid-commit ------------------------------------------------------------------------------------------


def test_a_kill_at_each_of_4_points_of_a_commit_then_a_rerun_gives_each_of_24_ids_once_and_the_same_outputs(
        data, reference, tmp_path):
    out, killed, previous = tmp_path / "out", None, None
    for point in KILL_POINTS:
        job = start(data, out, {KILL_AT_ENV: f"{point}:part-*-00001.parquet"})
        stderr = job.communicate(timeout=300)[1]
        assert job.returncode == -signal.SIGKILL, stderr[-2000:]
        if killed is not None:  # this run found the last one's lease and its leftovers
            assert f"took over from a run that is gone (host {socket.gethostname()}, process {killed}," in stderr
            assert ("removed 1 staging file(s)" in stderr) == (previous in ("written", "flushed")), stderr
        staged = [p.name for p in leftovers(out)]
        second = sorted((out / "results").glob("part-*-00001.parquet"))
        if point in ("written", "flushed"):  # not committed: a staging file no reader counts
            assert len(staged) == 1 and staged[0].endswith(f".{socket.gethostname()}-{job.pid}.tmp"), staged
        else:
            assert not staged and second and pq.read_table(second[-1]).num_rows == 2
        results_by_id(out)  # every part readable, no id twice
        killed, previous = job.pid, point

    parts = sorted((out / "results").glob("part-*.parquet"))
    cut = parts[0]  # a part an older version was writing in place when it died
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    lease = json.loads(lease_path(out).read_text())  # as if the last run had died with its node, 10 minutes ago
    lease_path(out).write_text(json.dumps({**lease, "host": "node-17"}))
    os.utime(lease_path(out), (time.time() - 600, time.time() - 600))

    done = run_cli(job_args(data, out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "took over from a run that is gone (host node-17," in done.stderr
    assert f"set aside 1 part(s) that cannot be read ({cut.name})" in done.stderr
    assert (out / "results" / ".damaged" / cut.name).exists() and not leftovers(out)
    assert_same_outputs(out, reference, data)


def test_a_part_counts_only_after_its_data_is_flushed_and_its_rename_flushed_too(tmp_path, monkeypatch):
    calls = []
    fsync, rename = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append(("rename", Path(b).name)) or rename(a, b))
    write_records([{"x": 1}], tmp_path / "part-0000-1-00000.parquet")
    assert calls == [("fsync", False), ("rename", "part-0000-1-00000.parquet"), ("fsync", True)]


# --- a full disk -------------------------------------------------------------------------------------------------


def the_last_line(stderr: str) -> str:
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1]


def test_a_full_512k_disk_while_writing_results_exits_2_last_line_and_a_rerun_after_it_grows_finishes_once(
        reference, tmp_path):
    data = make_prompts(tmp_path / "padded.parquet", pad_bytes=320 << 10)  # partitions fit, results do not
    with small_disk(tmp_path / "disk", "512k") as disk:
        out = disk / "out"
        done = run_cli(job_args(data, out, "output.progress=true"))
        assert done.returncode == 2, done.stderr[-2000:]
        line = the_last_line(done.stderr)
        assert line.startswith(f"batchprefill: error: the disk is full (No space left on device) writing "
                               f"{out / 'results'}/part-0000-"), done.stderr[-2000:]
        assert f"on the file system at {disk}; free space there" in line and "Traceback" not in done.stderr
        committed = results_by_id(out)  # every part committed before reads whole
        assert 0 < len(committed) < 24 and not leftovers(out)
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        done = run_cli(job_args(data, out))
        assert done.returncode == 0, done.stderr[-2000:]
        assert_same_outputs(out, reference, data)
        assert sorted(results_by_id(out)) == sorted(input_ids(data))


def test_a_full_256k_disk_while_writing_partitions_exits_2_naming_them_and_leaves_no_partitions(tmp_path):
    data = make_prompts(tmp_path / "padded.parquet", pad_bytes=320 << 10)
    with small_disk(tmp_path / "disk", "256k") as disk:
        out = disk / "out"
        done = run_cli(job_args(data, out))
        assert done.returncode == 2, done.stderr[-2000:]
        line = the_last_line(done.stderr)
        assert line.startswith(f"batchprefill: error: the disk is full (No space left on device) writing "
                               f"{out / 'partitions.staging'}: "), done.stderr[-2000:]
        assert not (out / "partitions").exists() and not (out / "partitions.staging").exists()


def test_a_full_disk_while_writing_statistics_is_disk_full_and_the_last_statistics_stay_whole(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        stats = disk / "stats"
        write_records([{"num_requests": 3}], stats / "job.parquet")
        fill(disk)
        with pytest.raises(DiskFull, match=f"writing {stats / 'groups.parquet'}: 0 B free of 64.0 KiB on the file "
                                           f"system at {disk}"):
            write_stats(stats, JobTotals(), [], {"num_requests": 24})
        assert pq.read_table(stats / "job.parquet").to_pylist() == [{"num_requests": 3}]
        assert sorted(p.name for p in stats.iterdir()) == ["job.parquet"]


def test_an_unforeseen_full_disk_is_exit_2_and_a_bugs_traceback_goes_where_there_is_room(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with small_disk(tmp_path / "disk", "64k") as disk:
        fill(disk)
        with pytest.raises(SystemExit) as stopped, reported_errors("batchprefill-run", disk), \
                open(disk / "hydra.log", "a") as log:  # the error comes from the flush: it names no file
            log.write("x" * 8192)
        assert stopped.value.code == 2
        assert capsys.readouterr().err.startswith(f"batchprefill-run: error: the disk is full (No space left on "
                                                  f"device) writing {disk}: 0 B free")
        with pytest.raises(SystemExit) as stopped, reported_errors("batchprefill-run", disk):
            json.loads("{")
        assert stopped.value.code == 70
        log = Path(capsys.readouterr().err.strip().rsplit(" ", 1)[1])
        assert log.parent == tmp_path / "tmp" and "JSONDecodeError" in log.read_text()
        assert not [p for p in disk.iterdir() if p.name.startswith("batchprefill-run-error-")]
    assert atomic.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))


def test_a_run_into_a_disk_that_is_still_full_exits_2_saying_so_before_hydra_writes_its_run_folder(data, tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        fill(disk)
        done = run_cli(job_args(data, disk / "out"))
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.strip() == ("batchprefill: error: the disk is full (No space left on device) writing "
                                       "Hydra's run folder (hydra.run.dir, under output.dir); free space there (or "
                                       "choose another output.dir) and rerun: what was committed stays, and the "
                                       "rerun resumes")
