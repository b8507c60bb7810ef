"""Files that appear whole: written aside, flushed, renamed over the target, and the rename flushed too.

A full disk is told apart from every other write fault: it raises `DiskFull`, naming the file and its file system.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from batchprefill.errors import DiskFull
from batchprefill.units import readable_bytes

if TYPE_CHECKING:  # matplotlib loads only where a figure is drawn
    from matplotlib.figure import Figure

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Test-only fault injection, read in `_killed_at` alone: POINT:GLOB makes a process SIGKILL itself at POINT of
# committing a file whose name matches GLOB. Points, in order: written, flushed, renamed, synced.
KILL_AT_ENV = "BATCHPREFILL_TEST_KILL_AT"
STAGING_SUFFIX = ".tmp"


def replace_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write` fills a staging file beside `path`, which then replaces it: a reader sees the whole file or none
    of it, even if this process is killed mid-write. The data is flushed before the rename and the folder entry
    after it, so once this returns a power loss cannot leave the name over missing data. A write that raises
    leaves `path` as it was and no staging file; a full disk raises DiskFull."""
    # host and pid: shards on two hosts writing one shared file (stats/partitions.parquet) never share a staging file
    staging = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}{STAGING_SUFFIX}")
    try:
        with disk_full_named(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            write(staging)
            _killed_at("written", path)
            fsync_file(staging)
            _killed_at("flushed", path)
            os.replace(staging, path)
            _killed_at("renamed", path)
            fsync_dir(path.parent)
            _killed_at("synced", path)
    finally:
        staging.unlink(missing_ok=True)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (a rename into it). A file system that cannot fsync a folder (EINVAL) makes its
    renames durable by itself (NFS commits a rename on the server before it returns)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
    finally:
        os.close(handle)


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


@contextmanager
def disk_full_named(path: Path) -> Iterator[None]:
    """A full disk met while writing `path` (pyarrow's OSErrors carry the errno too) becomes a DiskFull naming it."""
    try:
        yield
    except OSError as error:
        if is_disk_full(error):
            raise DiskFull(disk_full_message(error, path)) from error
        raise


def disk_full_message(error: OSError, path: Path | None, what: str | None = None) -> str:
    """The line a full disk ends a job with: which file (`path`, else `what` is written), which file system, and
    how much room is left there."""
    room = ""
    if path is not None:
        where = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
        mount = where
        while not mount.is_mount() and mount != mount.parent:
            mount = mount.parent
        usage = shutil.disk_usage(where)
        room = f": {readable_bytes(usage.free)} free of {readable_bytes(usage.total)} on the file system at {mount}"
    return (f"the disk is full ({os.strerror(error.errno or errno.ENOSPC)}) writing {what or path}{room}; free space "
            "there (or choose another output.dir) and rerun: what was committed stays, and the rerun resumes")


def _killed_at(point: str, path: Path) -> None:
    """Test-only: the tests set KILL_AT_ENV to crash a real job at each point of a commit; unset, one lookup."""
    wanted = os.environ.get(KILL_AT_ENV)
    if wanted:
        at, _, glob = wanted.partition(":")
        if at == point and fnmatch(path.name, glob):
            os.kill(os.getpid(), signal.SIGKILL)


def write_atomic(table: pa.Table, path: Path) -> None:
    replace_atomic(path, lambda staging: pq.write_table(table, staging))


def save_png(figure: Figure, path: Path) -> None:
    """plan.png and stats/run.png, written as atomically as the Parquet files."""
    replace_atomic(path, lambda staging: figure.savefig(staging, format="png", dpi=110))


def write_records(records: list[dict], path: Path, schema: pa.Schema | None = None) -> None:
    write_atomic(pa.Table.from_pylist(records, schema=schema), path)
