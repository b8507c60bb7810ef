"""Decode attention read in place from the paged KV pool: a small C++ kernel (`csrc/paged_decode.cpp`), built
on first use with the system's C++ compiler and loaded with ctypes.

Why: on the CPU a decode's own blocks were gathered into a padded copy (`index_select`) before a fused call,
per layer and step. With long answers that copy is most of the step: at 80 decodes with 450 own tokens each
(SmolLM2-135M, float32, 2 threads) the gather took 440 ms and the fused call on the copy 250 ms of a 1,270 ms
step. The kernel walks each decode's block list and keeps an online softmax, reading every key and value once
where it lies (`benchmarks/cpu_ops.py` has the side-by-side figure).

Why ctypes and not torch's cpp_extension: the source includes no torch header, so it compiles in under a
second (a torch extension takes about a minute on 2 cores and needs Python's headers and ninja), and nothing
has to be built at install, so the quickstart stays two commands. The library is cached under
`$XDG_CACHE_HOME/batchprefill/kernels`, keyed by the source, the flags, the compiler and the CPU's feature
flags (it is built with -march=native, and a shared home directory may serve several kinds of node). Where no
compiler works the torch path runs, with one warning.
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

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DISABLE_VARIABLE = "BATCHPREFILL_NATIVE_KERNELS"  # 0 = never build or load the kernel (the torch path runs)

_log = logging.getLogger(__name__)
_ENTRY_POINTS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


class PagedDecode:
    """The loaded kernel: `attend` for every KV dtype it has an entry point for."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in _ENTRY_POINTS.items():
            function = getattr(library, name)
            function.restype = None
            function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float] + \
                [ctypes.c_void_p] * 2 + [ctypes.c_int]
            self._functions[dtype] = function

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each item's query rows `[items, Hkv, rows, D]` against the first `lens[i]` tokens of its blocks
        `[items, width]` (int64): the attention `[items, Hkv, rows, D]` and its log-sum-exp `[items, Hkv, rows]`,
        both float32; an item with no token gets zeros and -inf."""
        items, kv_heads, rows, dim = query.shape
        query = query.to(torch.float32).contiguous()
        blocks, lens = blocks.contiguous(), lens.contiguous()
        out = torch.empty_like(query)
        lse = torch.empty(items, kv_heads, rows, dtype=torch.float32)
        self._functions[k_cache.dtype](
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), lens.data_ptr(),
            items, blocks.shape[1], k_cache.shape[1], kv_heads, rows, dim, scale, out.data_ptr(), lse.data_ptr(),
            torch.get_num_threads())
        return out, lse


@cache
def load() -> PagedDecode | None:
    """The kernel, built into the cache first if needed; None where it is disabled or cannot be built."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        _log.warning("no C++ compiler found: CPU decode attention gathers each context (slower on long outputs)")
        return None
    try:
        return PagedDecode(ctypes.CDLL(str(_built(compiler))))
    except subprocess.CalledProcessError as error:
        errors = [line for line in (error.stderr or "").splitlines() if "error" in line.lower()]
        reason = errors[0].strip() if errors else f"{compiler} exited {error.returncode}"
        _log.warning("CPU decode kernel not built (%s): decode attention gathers each context", reason)
    except OSError as error:
        _log.warning("CPU decode kernel not loaded (%s): decode attention gathers each context", error)
    return None


def _built(compiler: str) -> Path:
    """The library for this source, compiler and CPU, compiled into the cache unless it is there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_features()]).encode()).hexdigest()
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchprefill" / "kernels"
    target = folder / f"paged_decode-{key[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=folder)
    os.close(handle)
    try:
        subprocess.run([compiler, *FLAGS, "-o", staging, str(SOURCE)], capture_output=True, text=True, check=True)
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
