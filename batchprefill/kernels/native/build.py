"""The CPU path's C++ kernels (`kernels/native/csrc/*.cpp`): each built on first use with the system's C++
compiler and loaded with ctypes.

Why ctypes and not torch's cpp_extension: the sources include no torch header, so each compiles in about a
second (a torch extension takes about a minute on 2 cores and needs Python's headers and ninja), and nothing
has to be built at install, so the quickstart stays two commands. Libraries are cached under
`$XDG_CACHE_HOME/batchprefill/kernels`, keyed by the source, the flags, the compiler and the CPU's feature
flags (they are built with -march=native, and a shared home directory may serve several kinds of node). Where
no compiler works the torch ops run instead, with one warning. They link libgomp.so.1, which resolves to the
copy torch has already loaded, so kernels and torch's ops share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCES = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DISABLE_VARIABLE = "BATCHPREFILL_NATIVE_KERNELS"  # 0 = never build or load a kernel (the torch ops run)

_log = logging.getLogger(__name__)


@cache
def library(name: str) -> ctypes.CDLL | None:
    """`csrc/{name}.cpp` loaded, built into the cache first if needed; None where kernels are disabled or this one
    cannot be built (a warning says why)."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        _log.warning("no C++ compiler found: the CPU path runs %s as plain torch ops (slower)", name)
        return None
    try:
        return ctypes.CDLL(str(built(SOURCES / f"{name}.cpp", compiler)))
    except subprocess.CalledProcessError as error:
        errors = [line for line in (error.stderr or "").splitlines() if "error" in line.lower()]
        reason = errors[0].strip() if errors else f"{compiler} exited {error.returncode}"
        _log.warning("CPU kernel %s not built (%s): it runs as plain torch ops", name, reason)
    except OSError as error:
        _log.warning("CPU kernel %s not loaded (%s): it runs as plain torch ops", name, error)
    return None


def built(source: Path, compiler: str) -> Path:
    """The library for this source, compiler and CPU, compiled into the cache unless it is there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    headers = [header.read_text() for header in sorted(SOURCES.glob("*.h"))]  # what the sources may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *FLAGS, version, _cpu_features()]).encode()
                         ).hexdigest()
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchprefill" / "kernels"
    target = folder / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=folder)
    os.close(handle)
    try:
        subprocess.run([compiler, *FLAGS, "-o", staging, str(source)], capture_output=True, text=True, check=True)
        os.replace(staging, target)  # atomic: concurrent jobs on one node each build, and one copy wins
    finally:
        Path(staging).unlink(missing_ok=True)
    return target


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiled for), or the machine name where /proc says none."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()
