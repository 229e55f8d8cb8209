"""glibc's malloc, set for a process whose tensors live in host memory (the CPU engine's)."""

import ctypes
import sys

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> None:
    """Serve large blocks from malloc's heap and keep freed memory for reuse. By default glibc
    maps each block of a few MB afresh and unmaps it when freed, so a CPU step's activations and
    gathered K/V were new pages every step: ~125k page faults a run of the CPU benchmark, 0.2 s
    of system time and 8-9 % of a one-thread run (benchmark/RESULTS.md, 2026-12-02). A no-op
    where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl)
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # an int: the largest it takes
