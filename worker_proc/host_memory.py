"""Keeps freed host memory in the process for the next step instead of returning it to the OS,
and the KV cache off huge pages (without_huge_pages).

glibc's malloc serves every allocation above its mmap threshold (dynamic, at most 32 MiB)
with a fresh mmap and unmaps it on free. A CPU prefill step of 2048 tokens on the 0.5B
shape allocates an 80 MB gate/up output and a 40 MB SiLU product in each of 24 layers, so
every step page-faulted (and the kernel zeroed) about 3 GB anew. With large allocations
taken from the heap and the heap never trimmed, a step reuses the pages the previous one
freed: the 0.5B MLP at 2048 tokens took 364 ms instead of 410 ms (bench/log/2026-11-23.md). The
cost is that the process keeps its peak activation memory resident, which a worker
reuses on every step anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

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
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:  # no mallopt (macOS, Windows): nothing to tune
        return False
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    applied = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and applied
    if not applied:
        log.debug("mallopt refused the thresholds; large allocations stay mmapped")
    return applied


_MADV_NOHUGEPAGE = 15  # Linux's number


def without_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel for 4 KiB pages over [address, address + nbytes); True if it agreed.

    torch's allocator advises huge pages for every large CPU tensor (runtime/torch_env.py),
    which the KV cache does not want: its fresh blocks are written a few at a time, scattered
    over one plane per layer, K and V, so each step's first writes faulted in whole 2 MiB pages
    (the kernel zeroes each) for the few 8 KiB blocks they needed."""
    madvise = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    if nbytes <= 0 or madvise is None or not sys.platform.startswith("linux"):
        return False
    start = address - address % os.sysconf("SC_PAGE_SIZE")
    return madvise(start, address + nbytes - start, _MADV_NOHUGEPAGE) == 0


def _libc_function(name: str, argtypes: list):
    """``name`` from the C library the interpreter already links, returning int; None if absent."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function
