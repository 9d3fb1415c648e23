"""Keeps a CPU forward's large temporaries in the process's heap, where glibc's malloc reuses them.

glibc serves a request above its mmap threshold (128 KiB at first, moved as such blocks are freed) from pages mapped
for it alone and unmaps them on free, and trims the heap's free top above a threshold that follows it. An eager CPU
step allocates buffers of a few MiB that change size from step to step (the decode attention's gathered K and V, the
fused attention's own), so each came back as fresh pages: a page fault, and the kernel zeroing the page, for every
4 KiB of them, every step. With the mmap threshold at glibc's maximum and the trim threshold above the step's
temporaries, freed blocks stay in the heap and the next step takes them again (benchmarks/RESULTS.md, 2026-11-29).

A user's own MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (glibc's environment tunables) wins; another C library
(musl, macOS) or an allocator loaded in glibc's place is left as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit: requests up to it come from the heap
TRIM_THRESHOLD_BYTES = 256 << 20  # free heap kept before any goes back to the system
USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once per process; returns whether they were set (False where a user's tunable is
    set, or the C library has no mallopt)."""
    if any(name in os.environ for name in USER_TUNABLES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD_BYTES))
