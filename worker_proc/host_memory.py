"""Keeps freed host memory in the process for the next step instead of returning it to the OS.

glibc's malloc serves every allocation above its mmap threshold (dynamic, at most 32 MiB)
with a fresh mmap and unmaps it on free. A CPU prefill step of 2048 tokens on the 0.5B
shape allocates an 80 MB gate/up output and a 40 MB SiLU product in each of 24 layers, so
every step page-faulted (and the kernel zeroed) about 3 GB anew. With large allocations
taken from the heap and the heap never trimmed, a step reuses the pages the previous one
freed: the 0.5B MLP at 2048 tokens took 364 ms instead of 410 ms (bench/RESULTS.md). The
cost is that the process keeps its peak activation memory resident, which a worker
reuses on every step anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("pagedserve.worker")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Above any one activation of a realistic CPU step; the KV cache (larger) is still mmapped.
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the largest one (2 GiB of free heap top)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True if applied. The operator's own
    MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ (read by glibc at start) win."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter already links
    except (OSError, AttributeError):  # no mallopt (macOS, Windows): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    applied = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and applied
    if not applied:
        log.debug("mallopt refused the thresholds; large allocations stay mmapped")
    return applied
