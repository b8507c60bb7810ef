"""One live writer per shard of an output.dir: a second run of a shard exits 2 naming the live one before it
tokenizes anything; a lease whose run is gone (killed on this host, or another host's that stopped renewing) is
taken over; a run that lost its lease stops before its next commit."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from batchprefill.errors import JobError
from batchprefill.pipeline.shard_lock import LEASE_FOLDER, ShardLock, lease_name
from batchprefill.settings import Sharding
from tests.conftest import run_cli
from tests.test_resume import FAST, make_prompts

QUICK = ["sampling.max_tokens=8", "engine.max_num_seqs=4", "output.commit_every_rows=2"]
LABEL = "output.dir=OUT shard 0 of 1"


ONE = Sharding(num_shards=1, shard_index=0)


def lease_path(out: Path, sharding: Sharding = ONE) -> Path:
    return out / LEASE_FOLDER / lease_name(sharding.shard_index, sharding.num_shards)


def lock(out: Path, lease_seconds: float = 120, sharding: Sharding = ONE, host: str | None = None) -> ShardLock:
    return ShardLock(out / LEASE_FOLDER, sharding, LABEL, lease_seconds, host)


def job_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [str(Path(sys.executable).parent / "batchprefill-run"), f"data.input={data}", f"output.dir={out}",
            *FAST, *QUICK, *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet")


# --- the lease, in this process ----------------------------------------------------------------------------------


def test_a_second_lock_on_the_same_shard_names_the_live_holder_and_another_shard_of_its_array_is_free(tmp_path):
    holder = lock(tmp_path, sharding=Sharding(num_shards=2, shard_index=0))
    assert holder.acquire() is None
    try:
        with pytest.raises(JobError) as refused:
            lock(tmp_path, sharding=Sharding(num_shards=2, shard_index=0)).acquire()
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(holder.me.since))
        assert f"host {socket.gethostname()}, process {os.getpid()}, since {since}" in str(refused.value)
        other_shard = lock(tmp_path, sharding=Sharding(num_shards=2, shard_index=1))
        assert other_shard.acquire() is None  # shards of one array write the same folder at once
        other_shard.release()
        with pytest.raises(JobError, match="an array of 2 shards .* is writing this output.dir: host "):
            lock(tmp_path).acquire()  # one shard of 1 would write shard 0 of 2's rows again
    finally:
        holder.release()
    assert not any((tmp_path / LEASE_FOLDER).glob("*.json"))
    lock(tmp_path).acquire()


def test_a_pid_now_held_by_another_process_is_a_gone_holder_taken_over_at_once(tmp_path):
    reused = lock(tmp_path)
    reused.me = replace(reused.me, process_start="1")  # this pid, but a process that started at boot
    reused.acquire()
    taker = lock(tmp_path)
    gone = taker.acquire()
    assert gone is not None and gone.process_start == "1"
    assert json.loads(lease_path(tmp_path).read_text())["token"] == taker.me.token


def test_another_hosts_lease_holds_for_120_s_of_silence_and_is_taken_over_after(tmp_path):
    remote = lock(tmp_path, host="node-17")
    remote.acquire()
    ours = lock(tmp_path)
    old = time.time() - 100
    os.utime(lease_path(tmp_path), (old, old))
    with pytest.raises(JobError, match=r"host node-17, process \d+, since .*lease renewed 100 s ago, lapses after 120"):
        ours.acquire()
    old = time.time() - 121
    os.utime(lease_path(tmp_path), (old, old))
    gone = ours.acquire()
    assert gone is not None and gone.host == "node-17"
    remote.renew()  # node-17 comes back: its heartbeat finds the lease taken and it stops before writing
    with pytest.raises(JobError, match=f"taken over by another run \\(host {socket.gethostname()}"):
        remote.check()


def test_the_heartbeat_renews_a_1_s_lease_and_a_run_that_cannot_renew_it_stops_after_0_5_s(tmp_path):
    beating = lock(tmp_path, 1.0)  # renewed every 0.25 s
    beating.acquire()
    old = time.time() - 10
    os.utime(lease_path(tmp_path), (old, old))
    beating.start_heartbeat()
    time.sleep(0.8)
    assert time.time() - lease_path(tmp_path).stat().st_mtime < 5  # renewed since it was set 10 s back
    beating.check()
    beating.release()
    assert not lease_path(tmp_path).exists()

    silent = lock(tmp_path, 1.0)  # no heartbeat: as if the file system stopped answering
    silent.acquire()
    silent.check()
    time.sleep(0.6)
    with pytest.raises(JobError, match="could not renew its lease"):
        silent.check()


def test_without_flock_as_on_lustre_mounted_noflock_a_lease_is_still_taken_and_refused(tmp_path, monkeypatch):
    def refuse(handle, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", refuse)
    holder = lock(tmp_path)
    assert holder.acquire() is None
    with pytest.raises(JobError, match="is being written by another live run"):
        lock(tmp_path).acquire()
    holder.release()
    assert lock(tmp_path).acquire() is None


# --- real runs ---------------------------------------------------------------------------------------------------


def test_a_run_of_a_shard_this_process_holds_exits_2_before_tokenizing_naming_host_pid_and_since(data, tmp_path):
    out = tmp_path / "out"
    holder = lock(out)
    holder.acquire()
    try:
        done = run_cli(job_args(data, out))
    finally:
        holder.release()
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(holder.me.since))
    assert len(lines) == 1 and f"output.dir={out} shard 0 of 1 is being written by another live run: host " \
        f"{socket.gethostname()}, process {os.getpid()}, since {since}" in lines[0], done.stderr
    assert not (out / "partitions").exists() and not (out / "results").exists()
