"""Time limits (--max-queue-time-s, max_queue_time_s, deadline_s) and the deadline policy, driven
through the real Scheduler with a clock the test moves; and the step's clock replayed bit for bit."""

from __future__ import annotations

import pytest

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder, encode
from pagedserve.protocol.priority import QUEUE_TIMEOUT
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done

PROMPT = list(range(20, 28))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **overrides) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(debug_invariants=True, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64,
                             **overrides)
    return Scheduler(config, clock=clock), SimWorker(config, counting_tokens())


def add(sched: Scheduler, rid: str, max_tokens: int = 30, priority: int = 0, **limits) -> None:
    msg = request(rid, PROMPT, max_tokens=max_tokens, ignore_eos=True)
    msg.priority = priority
    for name, value in limits.items():
        setattr(msg, name, value)
    assert sched.add_request(msg) == []


def step(sched: Scheduler, worker: SimWorker) -> list:
    """One step; the deltas it produced, those of time limits first (as the engine sends them)."""
    out = sched.schedule()
    ended = sched.take_timed_out()
    return ended + list(sched.update_from_output(out, worker.step(out)))


def test_a_request_still_waiting_past_its_limit_ends_with_a_queue_timeout_naming_the_limit():
    clock = Clock()
    sched, worker = make(clock, max_num_seqs=1)
    add(sched, "running", max_tokens=40)
    add(sched, "patient")
    add(sched, "hurried", max_queue_time_s=5.0)
    step(sched, worker)  # both waiting ones are stamped at 100
    clock.now = 104.9
    assert [d for d in step(sched, worker) if d.finish_reason] == []
    clock.now = 105.0
    (ended,) = [d for d in step(sched, worker) if d.finish_reason]
    assert (ended.request_id, ended.finish_reason, ended.error_kind) == ("hurried", "error", QUEUE_TIMEOUT)
    assert "limit of 5.000s" in ended.error and "max_queue_time_s" in ended.error
    assert sched.stats()["num_queue_time_expired"] == 1
    assert set(sched.requests) == {"running", "patient"}  # nothing else is touched
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_the_server_limit_applies_to_every_request_and_a_request_may_only_ask_for_less():
    clock = Clock()
    sched, worker = make(clock, max_num_seqs=1, max_queue_time_s=10.0)
    add(sched, "running", max_tokens=60)
    add(sched, "default")
    add(sched, "shorter", max_queue_time_s=3.0)
    add(sched, "longer", max_queue_time_s=50.0)  # capped at the server's 10 s
    step(sched, worker)
    clock.now = 103.0
    assert [d.request_id for d in step(sched, worker) if d.finish_reason] == ["shorter"]
    clock.now = 110.0
    timed_out = [d for d in step(sched, worker) if d.finish_reason]
    assert sorted(d.request_id for d in timed_out) == ["default", "longer"]
    assert {d.error_kind for d in timed_out} == {QUEUE_TIMEOUT}
    assert list(sched.requests) == ["running"]  # the running one has its first token: no limit applies


def test_a_deadline_ends_generation_with_the_tokens_so_far_and_finish_reason_length():
    clock = Clock()
    sched, worker = make(clock, max_num_seqs=4)
    add(sched, "deadline", max_tokens=100, deadline_s=2.0)
    add(sched, "free", max_tokens=100)
    tokens = []
    for _ in range(5):
        tokens += [d for d in step(sched, worker) if d.request_id == "deadline"]
    clock.now = 102.0
    ended = [d for d in step(sched, worker) if d.request_id == "deadline"]
    assert [(d.finish_reason, d.error, d.new_token_ids) for d in ended] == [("length", None, [])]
    assert len([t for d in tokens for t in d.new_token_ids]) == 5  # what it had: the tokens so far
    assert "deadline" not in sched.requests and "free" in sched.requests
    stats = sched.stats()
    assert stats["num_deadline_expired"] == 1 and stats["deadline_misses_by_priority"] == {0: 1}
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_a_deadline_before_the_first_token_is_a_queue_timeout():
    clock = Clock()
    sched, worker = make(clock, max_num_seqs=1)
    add(sched, "running", max_tokens=40)
    add(sched, "late", deadline_s=1.0)
    step(sched, worker)
    clock.now = 101.0
    (ended,) = [d for d in step(sched, worker) if d.finish_reason]
    assert (ended.request_id, ended.error_kind) == ("late", QUEUE_TIMEOUT)


def test_the_deadline_policy_runs_the_earliest_deadline_first_within_a_priority():
    clock = Clock()
    sched, worker = make(clock, max_num_seqs=1, scheduling_policy="deadline", default_deadline_s=60.0)
    add(sched, "running", max_tokens=3)
    step(sched, worker)
    add(sched, "no-deadline")  # urgency 100 + 60
    add(sched, "loose", deadline_s=100.0)  # 100 + 100
    add(sched, "tight", deadline_s=30.0)  # 100 + 30
    add(sched, "tight-but-low", priority=1, deadline_s=5.0)  # a worse priority waits for all of them
    add(sched, "no-deadline-later")
    started = []
    run_until_done(sched, worker, on_step=lambda out, r, d: started.extend(x.req_id for x in out.new_requests))
    assert started == ["tight", "no-deadline", "no-deadline-later", "loose", "tight-but-low"]


def test_without_deadlines_the_deadline_policy_is_fcfs():
    clock = Clock()
    sched, worker = make(clock, max_num_seqs=2, scheduling_policy="deadline")
    for rid in ("a", "b", "c", "d", "e"):
        add(sched, rid, max_tokens=3)
        clock.now += 0.25
    started = []
    run_until_done(sched, worker, on_step=lambda out, r, d: started.extend(x.req_id for x in out.new_requests))
    assert started == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline", "fair"])
def test_a_run_with_time_limits_replays_bit_for_bit_from_the_recorded_clock(policy):
    """What trace replay does: the same inputs and results, each step handed its recorded now_s."""
    def drive(sched, worker, clocks):
        frames = []
        for turn in range(400):
            if turn < 12:
                msg = request(f"r{turn}", [20 + turn] * (3 + turn % 5), max_tokens=6 + turn, ignore_eos=True)
                msg.max_queue_time_s = 0.5 + (turn % 3) if turn % 2 else None
                msg.deadline_s = 3.0 if turn % 4 == 1 else None
                msg.priority = turn % 2 if policy in ("priority", "deadline") else 0
                msg.tenant = "ab"[turn % 2]
                sched.add_request(msg)
            if not sched.has_unfinished():
                break
            out = sched.schedule(clocks[len(frames)] if clocks else None)
            ended = sched.take_timed_out()
            frames.append((encode(out), [encode(d) for d in ended]))
            sched.update_from_output(out, worker.step(out))
        return frames

    clock = Clock()

    def tick() -> float:
        clock.now += 0.37  # time moves on between steps
        return clock.now

    config = dict(scheduling_policy=policy, max_num_seqs=3, max_queue_time_s=4.0,
                  priority_aging_s=1.0 if policy == "priority" else None)
    recorded_sched, worker = make(clock, **config)
    recorded_sched.clock = tick
    recorded = drive(recorded_sched, worker, None)
    clocks = [Decoder(m.SchedulerToWorker).decode(frame).now_s for frame, _ in recorded]
    replayed_sched, worker = make(Clock(), **config)
    replayed = drive(replayed_sched, worker, clocks)
    assert replayed == recorded
    assert any(ended for _, ended in recorded), "some request ran out of time"
