"""Random workloads drawn by hypothesis (so a failure shrinks to a small one): arrivals, aborts
(some while a step is out), swaps, recomputes, forks, prefix hits and outputs longer than the
decode lane's ring. Counting tokens (output i of a p-token prompt is 1000 + p + i) make every
token checkable: nothing lost, repeated or out of order, and an aborted request's tokens stop
at its abort and are a prefix of what it would have produced. Each runs with every step waiting
for its result or with the next scheduled ahead of it (async scheduling), drawn too."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.decode_lane import RING
from pagedserve.scheduler_proc.prefix_cache import block_key
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, assert_all_blocks_free, counting_tokens, request, step_clock

SHARED_PREFIX = [5] * 8  # some prompts start alike, so prefix caching has something to hit


@dataclass(frozen=True)
class Abort:
    step: int
    pick: int  # which unfinished request, by index in id order
    when: str  # before schedule(), or while the step is out (between schedule() and update_from_output())


arrivals = st.lists(st.tuples(st.integers(0, 30),  # arrival step
                              st.booleans(),  # starts with SHARED_PREFIX
                              st.lists(st.integers(10, 89), min_size=1, max_size=12),
                              st.integers(1, RING + 30),  # max_tokens
                              st.sampled_from([1, 1, 2])),  # n
                    min_size=1, max_size=10)
# "while out, per-object": a request with a prefill or fork in the step, not a lane decode
aborts = st.lists(st.builds(Abort, st.integers(0, 200), st.integers(0, 9),
                            st.sampled_from(["before", "while out", "while out, per-object"])), max_size=3)


def run_workload(config: SchedulerConfig, workload, abort_plan: list[Abort], ahead: bool = False,
                 proposer=None) -> None:
    """``ahead``: the engine loop of async scheduling, the next step scheduled before the
    result of the one out whenever the scheduler allows it (``while out`` then has two out).
    ``proposer``: speculative proposals (with ``config.speculative``; test_scheduler_speculation.py)."""
    clock = step_clock() if config.speculative else time.monotonic  # speculation prices a row by the clock
    sched, worker = Scheduler(config, proposer=proposer, clock=clock), SimWorker(config, counting_tokens())
    pending: deque = deque()
    prompts, ended_by_abort = {}, set()
    tokens: dict = {}  # (request id, sample index) -> tokens received
    abort_steps = {a.step: a for a in abort_plan}

    def receive(deltas) -> None:
        for d in deltas:
            assert not (d.request_id in ended_by_abort and d.new_token_ids), f"{d.request_id} got a token after its abort"
            tokens.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)

    def abort_one(pick: int, per_object_in=None) -> None:
        candidates = sorted(sched.requests)
        if per_object_in is not None:
            in_step = {r.req_id.split("/")[0] for r in (*per_object_in.new_requests, *per_object_in.cached_requests)}
            candidates = sorted(in_step & set(candidates)) or candidates
        if candidates:
            victim = candidates[pick % len(candidates)]
            receive(sched.abort_requests([victim]))
            ended_by_abort.add(victim)

    for step in range(3_000):
        for i, (at, shared, prompt, max_tokens, n) in enumerate(workload):
            if at == step:
                prompts[f"r{i}"] = (SHARED_PREFIX if shared else []) + prompt
                receive(sched.add_request(request(f"r{i}", prompts[f"r{i}"], max_tokens=max_tokens,
                                                  ignore_eos=True, n=n)))
        if not sched.has_unfinished() and not pending and all(at <= step for at, *_ in workload):
            break
        planned = abort_steps.get(step)
        if planned and planned.when == "before":
            abort_one(planned.pick)
        if not pending and sched.has_unfinished():
            pending.append(sched.schedule())
        if ahead and len(pending) == 1 and sched.has_unfinished() and sched.can_schedule_ahead():
            pending.append(sched.schedule())
        if planned and planned.when != "before":
            abort_one(planned.pick, pending[-1] if planned.when == "while out, per-object" and pending else None)
        if pending:
            out = pending.popleft()
            receive(sched.update_from_output(out, worker.step(out)))
        if config.enable_prefix_caching and step % 7 == 0:
            assert_block_keys_name_their_tokens(sched)
    else:
        raise AssertionError(f"workload did not finish: {sched.stats()}")
    for (request_id, index), got in tokens.items():
        p = len(prompts[request_id])
        assert got == [1000 + p + i for i in range(len(got))], (request_id, index)
    assert_all_blocks_free(sched)
    stats = sched.stats()
    event(f"swapped: {stats['num_preemptions_swap'] > 0}, prefix hits: {stats['prefix_cache_hits'] > 0}, "
          f"aborted: {bool(ended_by_abort)}, ahead: {ahead}")


def assert_block_keys_name_their_tokens(sched: Scheduler) -> None:
    """Keys named from the lane's ring equal the ones computed from each sequence's tokens."""
    block_size = sched.block_size
    for seq in sched.running_sequences():
        expected, parent = [], 0
        for i in range(len(seq.block_keys)):
            key = block_key(parent, seq.token_ids[i * block_size:(i + 1) * block_size].tobytes())
            expected.append(key)
            parent = key[2]
        assert seq.block_keys == expected, seq.seq_id


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4, 16]), num_gpu_blocks=st.integers(12, 60),
       num_cpu_blocks=st.sampled_from([0, 8, 40]), max_num_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), workload=arrivals, abort_plan=aborts, ahead=st.booleans())
def test_random_workloads_deliver_every_token_once_in_order(block_size, num_gpu_blocks, num_cpu_blocks,
                                                            max_num_seqs, prefix_caching, workload, abort_plan, ahead):
    run_workload(SchedulerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                 num_cpu_blocks=num_cpu_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max(16, max_num_seqs), max_model_len=160,
                                 enable_prefix_caching=prefix_caching, debug_invariants=True),
                 workload, abort_plan, ahead)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([2, 4, 8]), num_gpu_blocks=st.integers(12, 40),
       num_cpu_blocks=st.sampled_from([8, 40]), max_num_seqs=st.integers(2, 8),
       workload=arrivals, abort_plan=aborts, ahead=st.booleans())
def test_swap_preemption_with_prefix_caching_conserves_blocks_and_delivers_every_token(
        block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs, workload, abort_plan, ahead):
    # debug_invariants checks after every step that every block is free or owned with a
    # matching ref count, on both pools; the end state must have every block free.
    run_workload(SchedulerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                 num_cpu_blocks=num_cpu_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max(16, max_num_seqs), max_model_len=160,
                                 preemption_mode="swap", enable_prefix_caching=True, debug_invariants=True),
                 workload, abort_plan, ahead)
