"""One live writer per shard of an output.dir: a lease file per shard that the live run renews (a heartbeat), taken
over without a person once its run is gone.

Whether the holder is gone: on the same host (the same kernel and process-id namespace) its process is asked
directly, so a run killed with SIGKILL is taken over at once, and a later process given the same id is told apart
by its start time; a holder on another host is gone once its lease went `lease_seconds` without renewal (a lost
node). A run that could not renew its own lease for half that stops before its next commit, so a run that takes
over never writes beside it.

On shared file systems: the lease is created by link(2) and replaced by rename(2), atomic on a local disk, NFS and
Lustre; its age is the file's mtime, read through a fresh open (NFS's close-to-open revalidation), so it assumes
host clocks within a fraction of the lease (NTP keeps them within milliseconds). Check-and-take runs under flock,
which NFS and Lustre (mounted `flock`) make coherent across hosts; where it is not (Lustre `localflock` or
`noflock`, NFS `nolock`), two hosts racing for one expired lease are settled by reading the lease back: the last
rename wins and the other run exits 2 naming it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from batchprefill.errors import JobError
from batchprefill.io.atomic import STAGING_SUFFIX, disk_full_named
from batchprefill.io.results import clear_leftovers
from batchprefill.pipeline.manifest import locked
from batchprefill.report.stats import stats_dir
from batchprefill.settings import Sharding

LEASE_FOLDER = ".writers"  # under output.dir: one lease file per shard, and the flock file that guards them
RENEWALS_PER_LEASE = 4  # a heartbeat every lease/4: three can be missed before the lease lapses


@dataclass(frozen=True)
class Holder:
    """A lease's content: which run holds it."""

    host: str
    pid: int
    since: float  # time.time() when it took the lease
    token: str  # unique to this taking of the lease
    kernel: str  # boot id and pid namespace: another process can ask after `pid` only where these match its own
    process_start: str | None  # /proc/PID/stat's start time: the holder, not a later process given its pid

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        return f"host {self.host}, process {self.pid}, since {since}"


def _kernel() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _process_stat(pid: int) -> tuple[str, str] | None:
    """A process's state letter and start time (fields 3 and 22 of /proc/PID/stat), or None without /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], fields[19]


def _alive_here(holder: Holder) -> bool:
    """Whether the holder's process, on this host, still runs (a zombie does not: it writes nothing)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    stat = _process_stat(holder.pid)
    if stat is None:
        return True
    state, start = stat
    return state not in ("Z", "X") and (holder.process_start is None or start == holder.process_start)


def lease_name(shard_index: int, num_shards: int) -> str:
    return f"shard-{shard_index:04d}-of-{num_shards:04d}.json"


class ShardLock:
    """The lease of one shard: `acquire`, then `start_heartbeat`; `check` before each write; `release` at the end.

    Leases of another shard count in the same folder are rivals: a run of 1 shard and an array of 4 would both
    write shard 0's rows, so either is refused while the other lives."""

    def __init__(self, folder: Path, sharding: Sharding, label: str, lease_seconds: float, host: str | None = None):
        self.path = folder / lease_name(sharding.shard_index, sharding.num_shards)
        self.num_shards = sharding.num_shards
        self.label = label  # "output.dir=X shard I of N", for messages
        self.lease_seconds = lease_seconds
        stat = _process_stat(os.getpid())
        self.me = Holder(host or socket.gethostname(), os.getpid(), time.time(), uuid.uuid4().hex, _kernel(),
                         stat[1] if stat else None)
        self.renewed = time.monotonic()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> Holder | None:
        """Take the lease, or raise a JobError naming the live run that holds it; returns the gone run it took
        over from, if any."""
        gone = None
        with disk_full_named(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with locked(self.path.parent / ".lock", required=False):
                self._check_rivals()
                current = self._read()
                if current is None:
                    self._write(exclusive=True)
                else:
                    holder, age = current
                    if holder is not None and not self._gone(holder, age):
                        raise JobError(self._taken_by(holder, age))
                    self._write(exclusive=False)
                    gone = holder
            current = self._read()  # a host racing without a coherent flock: the last rename won
        if current is None or current[0] is None or current[0].token != self.me.token:
            raise JobError(self._taken_by(*current) if current and current[0] else
                           f"{self.label}: another run took its lease at the same time; rerun")
        self.renewed = time.monotonic()
        return gone

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="batchprefill-lease", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        """Touch the lease if it is still this run's; note it lost if another run took it. A file system that does
        not answer leaves `renewed` behind, which `check` acts on."""
        try:
            current = self._read()
            if current is None or current[0] is None or current[0].token != self.me.token:
                taken = (f"was taken over by another run ({current[0].describe()})" if current and current[0] else
                         f"file {self.path} is gone")
                self.lost = f"{self.label}: this run's lease {taken}; it stops here, and the rows it committed stay"
                return
            os.utime(self.path)
            self.renewed = time.monotonic()
        except OSError:
            return

    def check(self) -> None:
        """Raise a JobError unless this run still holds the lease and renewed it within half its length."""
        if self.lost:
            raise JobError(self.lost)
        silent = time.monotonic() - self.renewed
        if silent > self.lease_seconds / 2:
            raise JobError(f"{self.label}: this run could not renew its lease ({self.path}) for {silent:.0f} s (is the "
                           "file system reachable?); it stops before another run may take over: the rows it "
                           "committed stay, rerun to resume")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            current = self._read()
            if current is not None and current[0] is not None and current[0].token == self.me.token:
                self.path.unlink(missing_ok=True)
        except OSError:
            return

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_seconds / RENEWALS_PER_LEASE) and not self.lost:
            self.renew()

    def _check_rivals(self) -> None:
        for path in sorted(self.path.parent.glob("shard-*-of-*.json")):
            if path.name.endswith(f"-of-{self.num_shards:04d}.json"):
                continue
            current = self._read(path)
            if current is not None and current[0] is not None and not self._gone(*current):
                shards = int(path.stem.rpartition("-of-")[2])
                raise JobError(f"{self.label}: an array of {shards} shards (another data.num_shards) is writing this "
                               f"output.dir: {current[0].describe()}; wait for it to finish, or give this run "
                               "another output.dir")

    def _gone(self, holder: Holder, age: float) -> bool:
        if holder.host == self.me.host and holder.kernel == self.me.kernel:
            return not _alive_here(holder)
        return age > self.lease_seconds

    def _taken_by(self, holder: Holder, age: float) -> str:
        return (f"{self.label} is being written by another live run: {holder.describe()} (lease renewed "
                f"{max(age, 0):.0f} s ago, lapses after {self.lease_seconds:.0f} s); wait for it to finish or stop "
                "it, or give this run another output.dir")

    def _read(self, path: Path | None = None) -> tuple[Holder | None, float] | None:
        """A lease's holder (None when the file is not a lease) and its age in seconds, this shard's unless `path`
        names another; None without a lease."""
        try:
            with open(path or self.path, "rb") as handle:  # a fresh open: NFS revalidates the cached mtime
                age = time.time() - os.fstat(handle.fileno()).st_mtime
                data = handle.read()
        except FileNotFoundError:
            return None
        try:
            return Holder(**json.loads(data)), age
        except (ValueError, TypeError):
            return None, age

    def _write(self, exclusive: bool) -> None:
        """This run's lease, appearing whole: linked into place when there is none (fails if a racer made one),
        else renamed over the gone run's."""
        staging = self.path.with_name(f".{self.path.name}.{self.me.token}{STAGING_SUFFIX}")
        try:
            staging.write_text(json.dumps(asdict(self.me)))
            if exclusive:
                try:
                    os.link(staging, self.path)
                except FileExistsError:
                    return  # the read-back names the racer
            else:
                os.replace(staging, self.path)
        finally:
            staging.unlink(missing_ok=True)


def refuse_beside_live_writer(out: Path, lease_seconds: float, command: str) -> None:
    """A command that rewrites what a run reads (the plan remakes `partitions/` for its settings) refuses an
    output.dir that a live run of any shard is writing, naming that run, as a second run would be refused."""
    folder = out / LEASE_FOLDER
    probe = ShardLock(folder, Sharding(1, 0), f"output.dir={out}", lease_seconds)
    for path in sorted(folder.glob("shard-*-of-*.json")):
        current = probe._read(path)
        if current is not None and current[0] is not None and not probe._gone(*current):
            holder, age = current
            raise JobError(f"output.dir={out} is being written by a live run: {holder.describe()} (lease renewed "
                           f"{max(age, 0):.0f} s ago); {command} would remake the partitions it reads: wait for it "
                           "to finish, or give this command another output.dir")


@contextmanager
def sole_writer(out: Path, sharding: Sharding, lease_seconds: float) -> Iterator[ShardLock]:
    """This run as the one live writer of its shard of `out`, before anything is tokenized: a live holder ends it
    with exit 2 naming that run; a gone one is taken over. Then what a crashed writer of this shard left is cleared
    (reported in one line), and the lease is renewed until the run ends."""
    label = f"output.dir={out} shard {sharding.shard_index} of {sharding.num_shards}"
    lock = ShardLock(out / LEASE_FOLDER, sharding, label, lease_seconds)
    gone = lock.acquire()
    try:
        if gone is not None:
            print(f"batchprefill: {label}: took over from a run that is gone ({gone.describe()})", file=sys.stderr)
        cleared = clear_leftovers(out / "results", sharding.shard_index, stats_dir(out, sharding))
        if cleared:
            print(f"batchprefill: {label}: leftovers of a crashed run: {'; '.join(cleared)}", file=sys.stderr)
        lock.start_heartbeat()
        yield lock
    finally:
        lock.release()
