"""Keep freed memory in the process: every engine step allocates and frees the same large buffers.

glibc serves allocations above its mmap threshold (128 KiB at first) with fresh mappings and trims freed
heap back to the OS, so each step's activations and KV gathers page-fault in anew: that halves CPU decode
speed. Raising both thresholds lets the allocator reuse the memory it already has.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
