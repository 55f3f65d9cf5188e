"""Property: over random workloads (arrivals, aborts, preemption by swap and recompute,
n > 1 forks with copy-on-write, prefix hits, chunked prefill, blocks freed behind a sliding window,
a hybrid model's local tables freed behind theirs),
with every step awaited or
with the next one scheduled ahead of its result (async scheduling), no sequence ever attends over
a stale KV slot, zeroing never wipes live KV, every step drains the zero list, the debug
invariants hold after every call, and at the end every block of both pools is free.

The simulated worker (test_scheduler_support.SimWorker) checks the slot contents; this
file adds the bookkeeping of *when* blocks were zeroed relative to their first write.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, StepDriver, assert_all_blocks_free, random_tokens, request

PREFIXES = [list(range(100, 140)), list(range(200, 213)), [7] * 30]

configs = st.builds(
    SchedulerConfig,
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_gpu_blocks=st.integers(6, 30),
    num_cpu_blocks=st.sampled_from([0, 6, 40, 40]),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.sampled_from([8, 12, 16, 64]),
    max_model_len=st.sampled_from([48, 96]),
    enable_prefix_caching=st.booleans(),
    enable_chunked_prefill=st.booleans(),
    preemption_mode=st.sampled_from(["auto", "recompute"]),
    debug_invariants=st.just(True),
    sliding_window=st.sampled_from([0, 0, 1, 3, 8]),  # blocks behind it are freed (sliding_window.py)
)
# "swap" preempts by swap whenever the host has room (it needs a host pool).
configs = configs.map(lambda c: c if not c.num_cpu_blocks or c.enable_prefix_caching
                      else SchedulerConfig(**{**{k: getattr(c, k) for k in c.__slots__},
                                              "preemption_mode": "swap"}))
# Global and local layers alternating (block_manager.py): 1 or 2 local tables per sequence, where
# no window is on every layer.
configs = st.tuples(configs, st.sampled_from([(0, 0), (1, 1), (1, 3), (1, 8), (2, 5)])).map(
    lambda pair: pair[0] if pair[0].sliding_window or not pair[1][0] else SchedulerConfig(
        **{**{k: getattr(pair[0], k) for k in pair[0].__slots__},
           "num_window_groups": pair[1][0], "hybrid_window": pair[1][1]}))

arrivals = st.lists(
    st.tuples(
        st.integers(0, 3),  # steps to wait before this arrival
        st.integers(-1, len(PREFIXES) - 1),  # shared prefix (-1: none)
        st.integers(1, 14),  # own tokens after the prefix
        st.sampled_from([1, 1, 2, 3]),  # n
        st.integers(1, 24),  # max_tokens
        st.one_of(st.none(), st.integers(0, 6)),  # abort this many steps after arrival
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, plan=arrivals, seed=st.integers(0, 2**16), ahead=st.booleans())
def test_random_workloads_never_expose_stale_kv_and_leak_no_blocks(config, plan, seed, ahead):
    rng = random.Random(seed)
    sched = Scheduler(config)
    worker = SimWorker(config, random_tokens(rng, eos_probability=0.08))
    driver = StepDriver(sched, worker, ahead)
    pending = []  # (step at which it arrives, AddRequest, abort delay)
    step_at = 0
    for i, (delay, prefix, own, n, max_tokens, abort_after) in enumerate(plan):
        step_at += delay
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + [rng.randrange(10, 90) for _ in range(own)]
        msg = request(f"r{i}", prompt[: config.max_model_len - 1], max_tokens=max_tokens, n=n)
        pending.append((step_at, msg, abort_after))
    aborts: dict[int, list[str]] = {}
    finished_ids: set[str] = set()
    freshly_zeroed: set[int] = set()  # listed for zeroing, not yet written
    steps_scheduled = []

    def check_scheduled(out) -> None:
        assert out.step == len(steps_scheduled) + 1
        steps_scheduled.append(out.step)
        assert not sched.bm.pending_zero, "schedule() must drain the zero list"
        new_ids = {r.req_id for r in out.new_requests}
        assert not new_ids & set(out.finished_req_ids), "one id both dropped and added in a step"

    run_step = worker.step

    def run_and_check_zeroing(out):
        """Zeroing and writes in the order the worker runs steps (a step ahead is scheduled
        before the one out has written anything)."""
        for block in out.new_block_ids_to_zero:
            assert block not in freshly_zeroed, f"block {block} zeroed twice before any write"
            freshly_zeroed.add(block)
        result = run_step(out)  # raises on any stale or wiped slot
        for req_id in [r.req_id for r in (*out.new_requests, *out.cached_requests)] + out.decodes.req_ids:
            held = worker.held[req_id]
            for table in (held.block_ids, *held.window_tables):
                freshly_zeroed.difference_update(table)
        return result

    worker.step = run_and_check_zeroing

    for step in range(2_000):
        for arrive_at, msg, abort_after in [p for p in pending if p[0] == step]:
            deltas = sched.add_request(msg)
            if deltas:  # can never fit: an immediate, explained error
                assert all(d.finish_reason == "error" and d.error_kind == "invalid_request" for d in deltas)
                finished_ids.add(msg.request_id)
            elif abort_after is not None:
                aborts.setdefault(step + abort_after, []).append(msg.request_id)
        for delta in sched.abort_requests(aborts.pop(step, [])):
            assert delta.finish_reason == "abort"
            finished_ids.add(delta.request_id)
        if not driver.busy() and all(p[0] <= step for p in pending):
            break
        driver.on_schedule = check_scheduled
        _, _, deltas = driver.step()
        for delta in deltas:
            if delta.finish_reason is not None:
                finished_ids.add(delta.request_id)
    else:
        raise AssertionError(f"workload did not finish: {sched.stats()}")

    assert finished_ids == {msg.request_id for _, msg, _ in pending}
    assert_all_blocks_free(sched)
    stats = sched.stats()
    assert not sched.requests and stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
