"""The priority policy (--scheduling-policy priority), driven through the real Scheduler with a
simulated worker that checks every KV slot (the zeroing rule): random workloads under both
policies, then the behaviours one by one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.protocol.priority import priority_refusal
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import (
    SimWorker, StepDriver, assert_all_blocks_free, counting_tokens, request as fcfs_request, run_until_done,
)

arrivals = st.lists(st.tuples(st.integers(0, 25),  # arrival step
                              st.lists(st.integers(10, 89), min_size=1, max_size=20),  # prompt
                              st.integers(1, 40),  # max_tokens
                              st.sampled_from([1, 1, 1, 2]),  # n
                              st.integers(0, 2)),  # priority (0 under fcfs)
                    min_size=1, max_size=12)


def _key(seq) -> tuple[int, int]:
    return seq.request.priority, seq.order


def run(config: SchedulerConfig, workload, ahead: bool) -> tuple[Scheduler, dict, list]:
    """Returns the scheduler, each request's turns of its first step and its first token, and every preemption as
    (victim, every running sequence's key at that moment)."""
    sched, worker = Scheduler(config), SimWorker(config, counting_tokens())
    preemptions = []
    preempt = sched._preempt

    def spy(seq, batch):
        preemptions.append((_key(seq), [_key(s) for s in sched.running]))
        preempt(seq, batch)

    sched._preempt = spy
    driver = StepDriver(sched, worker, ahead)
    first_token: dict[str, int] = {}  # -1: refused
    started: dict[str, int] = {}
    driver.on_schedule = lambda out: [started.setdefault(r.req_id.split("/")[0], turn) for r in out.new_requests]
    for turn in range(5_000):
        for i, (at, prompt, max_tokens, n, priority) in enumerate(workload):
            if at == turn:
                deltas = sched.add_request(request(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True, n=n,
                                                   priority=priority if config.scheduling_policy == "priority" else 0))
                if deltas:  # n above max_num_seqs: refused, and out of the ordering
                    assert deltas[0].error_kind == "invalid_request", deltas
                    first_token[f"r{i}"] = started[f"r{i}"] = -1
        if not driver.busy():
            if all(at <= turn for at, *_ in workload):
                break
            continue
        _, _, outputs = driver.step()
        for d in outputs:
            if d.new_token_ids:
                first_token.setdefault(d.request_id, turn)
    else:
        raise AssertionError(f"workload did not finish: {sched.stats()}")
    return sched, {rid: (started[rid], first_token[rid]) for rid in first_token}, preemptions


def request(request_id: str, prompt: list[int], priority: int = 0, **sampling):
    add = fcfs_request(request_id, prompt, **sampling)
    add.priority = priority
    return add


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["fcfs", "priority"]), block_size=st.sampled_from([2, 4, 8]),
       num_gpu_blocks=st.integers(10, 48), num_cpu_blocks=st.sampled_from([0, 8, 40]),
       max_num_seqs=st.integers(1, 6), prefix_caching=st.booleans(), workload=arrivals, ahead=st.booleans())
def test_random_workloads_under_each_policy(policy, block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs,
                                            prefix_caching, workload, ahead):
    config = SchedulerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max(16, max_num_seqs),
                             max_model_len=160, enable_prefix_caching=prefix_caching, debug_invariants=True,
                             scheduling_policy=policy)
    sched, starts_and_firsts, preemptions = run(config, workload, ahead)
    # blocks conserved (debug_invariants checked every step; the SimWorker checked every slot's zeroing)
    assert_all_blocks_free(sched)
    # a victim is always the newest of the lowest priority present
    for victim, running in preemptions:
        assert victim == max(running), (victim, running)
    # within a class, requests start in arrival order, and so do the first tokens of single samples
    # (a request with n > 1 samples a step after its start: its prompt forks first)
    by_arrival = sorted(range(len(workload)), key=lambda i: (workload[i][0], i))
    for level in {w[4] for w in workload} if policy == "priority" else {None}:
        members = [i for i in by_arrival if level is None or workload[i][4] == level]
        starts = [starts_and_firsts[f"r{i}"][0] for i in members if starts_and_firsts[f"r{i}"][0] >= 0]
        assert starts == sorted(starts), (level, starts)
        firsts = [starts_and_firsts[f"r{i}"][1] for i in members if workload[i][3] == 1]
        assert firsts == sorted(firsts), (level, firsts)
    event(f"{policy}: preemptions {bool(preemptions)}")


def make(**overrides) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(debug_invariants=True, scheduling_policy="priority", **overrides)
    return Scheduler(config), SimWorker(config, counting_tokens())


def ids(out) -> list[str]:
    return sorted([r.req_id for r in (*out.new_requests, *out.cached_requests)] + out.decodes.req_ids)


def step(sched, worker):
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_waiting_request_of_higher_priority_preempts_the_newest_of_the_lowest_priority(mode):
    sched, worker = make(block_size=4, num_gpu_blocks=64, num_cpu_blocks=32, max_num_seqs=3,
                         max_num_batched_tokens=64, preemption_mode=mode)
    for rid, priority in (("low-old", 5), ("mid", 1), ("low-new", 5)):
        sched.add_request(request(rid, list(range(20, 28)), priority, max_tokens=30, ignore_eos=True))
    sched.add_request(request("low-waiting", list(range(20, 28)), 5, max_tokens=30, ignore_eos=True))
    step(sched, worker)
    step(sched, worker)  # every seat taken
    sched.add_request(request("urgent", list(range(40, 48)), 0, max_tokens=3, ignore_eos=True))
    out = step(sched, worker)
    assert out.finished_req_ids == ["low-new"]  # the newest of the lowest priority gave way at once
    assert ids(out) == ["low-old", "mid", "urgent"]
    while "urgent" in sched.requests:
        out = step(sched, worker)
    # the victim comes back before the newer waiting request of its class
    out = step(sched, worker)
    assert "low-new" in ids(out) and "low-waiting" not in ids(out)
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_equal_or_lower_priority_never_preempts_and_fcfs_holds_within_a_class():
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    for rid in ("a", "b"):
        sched.add_request(request(rid, list(range(20, 28)), 3, max_tokens=6, ignore_eos=True))
    step(sched, worker)
    sched.add_request(request("same", list(range(20, 28)), 3, max_tokens=2, ignore_eos=True))
    sched.add_request(request("worse", list(range(20, 28)), 9, max_tokens=2, ignore_eos=True))
    sched.add_request(request("same-later", list(range(20, 28)), 3, max_tokens=2, ignore_eos=True))
    started = []
    run_until_done(sched, worker, on_step=lambda out, r, d: started.extend(x.req_id for x in out.new_requests))
    assert started == ["same", "same-later", "worse"]
    assert sched.stats()["num_preemptions_recompute"] + sched.stats()["num_preemptions_swap"] == 0


def test_aging_lifts_a_waiting_request_one_level_per_interval():
    now = [0.0]
    config = SchedulerConfig(debug_invariants=True, scheduling_policy="priority", priority_aging_s=10.0,
                             block_size=4, num_gpu_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
    sched = Scheduler(config, clock=lambda: now[0])
    worker = SimWorker(config, counting_tokens())
    sched.add_request(request("running", list(range(20, 28)), 0, max_tokens=4, ignore_eos=True))
    step(sched, worker)
    sched.add_request(request("old-low", list(range(20, 28)), 2, max_tokens=2, ignore_eos=True))
    step(sched, worker)  # its arrival is stamped with this step's clock, 0
    now[0] = 25.0  # old-low has waited two intervals: level 0
    sched.add_request(request("new-high", list(range(20, 28)), 1, max_tokens=2, ignore_eos=True))
    started = []
    run_until_done(sched, worker, on_step=lambda out, r, d: started.extend(x.req_id for x in out.new_requests))
    assert started == ["old-low", "new-high"]


def test_a_non_zero_priority_is_refused_under_fcfs_and_a_full_queue_sheds():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=1, max_num_batched_tokens=64,
                             max_waiting_requests=1)
    sched = Scheduler(config)
    (delta,) = sched.add_request(request("r", [20, 21], 1))
    assert delta.error_kind == "invalid_request" and delta.error == priority_refusal("fcfs", 1)
    assert "--scheduling-policy priority or deadline" in delta.error
    assert sched.add_request(request("a", [20, 21])) == []
    (delta,) = sched.add_request(request("b", [20, 21]))  # "a" waits: the limit of one is reached
    assert delta.finish_reason == "error" and delta.error_kind == "overloaded"
    assert "--max-waiting-requests" in delta.error
    with pytest.raises(ValueError, match="priority_aging_s"):
        SchedulerConfig(priority_aging_s=5.0)
