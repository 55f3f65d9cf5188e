"""A draining replica refuses new requests with an error and finishes the ones it holds."""

from __future__ import annotations

from pagedserve.protocol import messages as m
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.frontend_inputs import apply_frontend_message
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done


def test_after_drain_new_requests_get_an_error_and_held_ones_still_finish_and_can_be_aborted():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=32,
                             debug_invariants=True)
    sched, worker = Scheduler(config), SimWorker(config, counting_tokens())
    draining = False
    for rid in ("kept", "aborted"):
        deltas, draining = apply_frontend_message(sched, request(rid, [5, 6, 7], max_tokens=6, ignore_eos=True),
                                                  draining)
        assert deltas == [] and not draining
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))

    deltas, draining = apply_frontend_message(sched, m.Drain(), draining)
    assert deltas == [] and draining
    deltas, draining = apply_frontend_message(sched, request("late", [8, 9], max_tokens=2), draining)
    assert draining and [(d.request_id, d.finish_reason, d.error_kind) for d in deltas] == [("late", "error", "engine")]
    assert "shutting down" in deltas[0].error and "late" not in sched.requests
    deltas, draining = apply_frontend_message(sched, m.AbortRequest(["aborted"]), draining)
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("aborted", "abort")]

    finished = run_until_done(sched, worker)
    assert [(d.request_id, d.finish_reason) for d in finished if d.finish_reason] == [("kept", "length")]
    assert draining
    assert_all_blocks_free(sched)
