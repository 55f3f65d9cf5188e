"""libgomp's spin count and torch's huge-page allocations, set before any process of a deployment
loads torch.

libgomp reads the first once, when torch loads OpenMP, and torch's CPU allocator the second at its
first allocation: the worker applies them before its imports, and so does the fork server
(deploy/fork_server.py), which loads torch for the processes it forks.
"""

from __future__ import annotations

import os


def apply_torch_env_defaults() -> None:
    # libgomp's threads spin a while after each parallel op before they sleep. A step's ops
    # follow each other within ~0.1 ms, so a short spin (10k iterations, ~0.2 ms here) keeps the
    # pool hot through a step, while a thread waiting between steps sleeps almost at once. Quiet
    # 2 cores, small bench shape (bench/log/2026-11-25.md): offline 1438 tok/s against 1078 sleeping at
    # once (PASSIVE) and ~1290 at 3k; serving 64 streams TPOT 43-46 ms against 56 ms. libgomp's
    # own default (300k, ~6 ms) holds a core the scheduler and frontend need. OMP_WAIT_POLICY or
    # GOMP_SPINCOUNT set by the environment win (PASSIVE for cores shared with other tenants:
    # README, "CPU cores").
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    # torch puts each CPU allocation of 2 MiB or more on 2 MiB pages (aligned, MADV_HUGEPAGE). A
    # step streams GBs of weights, and on 4 KiB pages every 4 KiB of them misses the TLB: the
    # 0.5B shape's 24 layers of projections at 8 rows took 60-67 ms against 72-77 (AVX2 Zen 4,
    # bench/log/2026-11-28.md "CPU: huge pages and a fused SiLU gate"). THP_MEM_ALLOC_ENABLE=0 turns it off.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def huge_pages_state() -> str:
    """What the worker's log says of huge pages: whether torch asks for them and the kernel grants them."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") in ("0", ""):
        return "off (THP_MEM_ALLOC_ENABLE=0)"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return "asked for; this kernel has no transparent huge pages"
    return "off (the kernel's THP mode is never)" if "[never]" in mode else "on"
