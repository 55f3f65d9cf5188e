"""The scheduler tests' simulated worker (support/scheduler_sim.py) catches what it exists to
catch: a block handed out without being zeroed."""

from __future__ import annotations

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, WorkerModelError, counting_tokens, request


def test_the_simulated_worker_rejects_a_block_that_was_never_zeroed():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=4, max_num_seqs=4, max_num_batched_tokens=16)
    sched = Scheduler(config)
    worker = SimWorker(config, counting_tokens())
    sched.add_request(request("a", [5, 6, 7]))
    out = sched.schedule()
    out.new_block_ids_to_zero.clear()  # what a scheduler with the #35219 bug would send
    try:
        worker.step(out)
    except WorkerModelError as exc:
        assert "stale" in str(exc)
    else:
        raise AssertionError("a stale slot went unnoticed")
