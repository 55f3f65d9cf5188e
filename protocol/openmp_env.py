"""libgomp's spin count, set before any process of a deployment loads torch.

libgomp reads it once, when torch loads OpenMP: the worker applies it before its imports, and
so does the fork server (deploy/fork_server.py), which loads torch for the processes it forks.
"""

from __future__ import annotations

import os


def apply_openmp_defaults() -> None:
    # libgomp's threads spin a while after each parallel op before they sleep. A step's ops
    # follow each other within ~0.1 ms, so a short spin (10k iterations, ~0.2 ms here) keeps the
    # pool hot through a step, while a thread waiting between steps sleeps almost at once. Quiet
    # 2 cores, small bench shape (bench/RESULTS.md): offline 1438 tok/s against 1078 sleeping at
    # once (PASSIVE) and ~1290 at 3k; serving 64 streams TPOT 43-46 ms against 56 ms. libgomp's
    # own default (300k, ~6 ms) holds a core the scheduler and frontend need. OMP_WAIT_POLICY or
    # GOMP_SPINCOUNT set by the environment win (PASSIVE for cores shared with other tenants:
    # README, "CPU cores").
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
