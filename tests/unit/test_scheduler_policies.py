"""Every scheduling policy (fcfs, priority, deadline, fair) under random workloads with priorities,
tenants and time limits, through the real Scheduler and a simulated worker that checks every KV
slot (the zeroing rule). The clock is the turn number, so time limits fall at known steps."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.protocol.priority import POLICIES_WITH_PRIORITY, QUEUE_TIMEOUT
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, StepDriver, assert_all_blocks_free, counting_tokens, request

POLICIES = ["fcfs", "priority", "deadline", "fair"]
limits = st.one_of(st.none(), st.integers(1, 30).map(float))
arrivals = st.lists(st.tuples(st.integers(0, 25),  # arrival turn
                              st.lists(st.integers(10, 89), min_size=1, max_size=20),  # prompt
                              st.integers(1, 40),  # max_tokens
                              st.sampled_from([1, 1, 1, 2]),  # n
                              st.integers(0, 2),  # priority (0 where the policy refuses others)
                              st.sampled_from(["a", "b", "c"]),  # tenant
                              limits,  # max_queue_time_s
                              limits),  # deadline_s
                    min_size=1, max_size=12)


def run(config: SchedulerConfig, workload, ahead: bool):
    """Returns the scheduler, per request (first scheduled turn, first token turn, last turn, finish
    reasons, error kinds), every preemption as (victim, running, tenant counters) and every
    admission as (admitted, waiting, tenant counters)."""
    turn = [0]
    sched, worker = Scheduler(config, clock=lambda: float(turn[0])), SimWorker(config, counting_tokens())
    preemptions, admissions = [], []
    preempt, admit = sched._preempt, sched._admit
    counters = lambda: dict(getattr(sched.policy, "counters", {}))  # noqa: E731

    def spy_preempt(seq, batch):
        preemptions.append((seq, list(sched.running), counters()))
        preempt(seq, batch)

    def spy_admit(plan, batch):
        admissions.append((plan.seq, list(sched.waiting), counters()))
        admit(plan, batch)

    sched._preempt, sched._admit = spy_preempt, spy_admit
    driver = StepDriver(sched, worker, ahead)
    seen: dict[str, dict] = {}
    driver.on_schedule = lambda out: [seen[r.req_id.split("/")[0]].setdefault("start", turn[0])
                                      for r in out.new_requests]
    with_priority = config.scheduling_policy in POLICIES_WITH_PRIORITY
    for turn[0] in range(5_000):
        for i, (at, prompt, max_tokens, n, priority, tenant, queue_s, deadline_s) in enumerate(workload):
            if at == turn[0]:
                add = request(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True, n=n)
                add.priority, add.tenant = priority if with_priority else 0, tenant
                add.max_queue_time_s, add.deadline_s = queue_s, deadline_s
                seen[f"r{i}"] = {"finish": [], "kinds": []}
                for d in sched.add_request(add):  # n above max_num_seqs: refused
                    assert d.error_kind == "invalid_request", d
                    seen[f"r{i}"]["refused"] = True
        if not driver.busy():
            if all(w[0] <= turn[0] for w in workload):
                break
            continue
        _, _, outputs = driver.step()
        for d in [*driver.timed_out, *outputs]:
            info = seen[d.request_id]
            if d.new_token_ids:
                info.setdefault("first", turn[0])
                info["last"] = turn[0]
            if d.finish_reason:
                info["finish"].append(d.finish_reason)
                info["kinds"].append(d.error_kind)
        driver.timed_out.clear()
    else:
        raise AssertionError(f"workload did not finish: {sched.stats()}")
    return sched, seen, preemptions, admissions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), block_size=st.sampled_from([2, 4, 8]),
       num_gpu_blocks=st.integers(10, 48), num_cpu_blocks=st.sampled_from([0, 8, 40]),
       max_num_seqs=st.integers(1, 6), prefix_caching=st.booleans(), workload=arrivals, ahead=st.booleans(),
       server_queue_s=limits)
def test_random_workloads_under_every_policy(policy, block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs,
                                             prefix_caching, workload, ahead, server_queue_s):
    config = SchedulerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max(16, max_num_seqs),
                             max_model_len=160, enable_prefix_caching=prefix_caching, debug_invariants=True,
                             scheduling_policy=policy, max_queue_time_s=server_queue_s, default_deadline_s=30.0)
    sched, seen, preemptions, admissions = run(config, workload, ahead)
    # blocks conserved (debug_invariants checked every step; the SimWorker checked every slot's zeroing)
    assert_all_blocks_free(sched)
    assert not sched.requests
    with_priority = policy in POLICIES_WITH_PRIORITY

    def priority(seq) -> int:
        return seq.request.priority

    # a victim is of the lowest priority present; within it the newest (deadline: latest first, then
    # newest; fair: of the tenant served most, the newest)
    for victim, running, counters in preemptions:
        assert priority(victim) == max(map(priority, running))
        peers = [s for s in running if priority(s) == priority(victim)]
        if policy == "deadline":
            assert (victim.request.urgency, victim.order) == max((s.request.urgency, s.order) for s in peers)
        elif policy == "fair" and len({s.request.tenant for s in peers}) > 1:
            most = max(counters.get(s.request.tenant, 0.0) for s in peers)
            assert counters.get(victim.request.tenant, 0.0) == most
            assert victim.order == max(s.order for s in peers if s.request.tenant == victim.request.tenant)
        else:
            assert victim.order == max(s.order for s in peers), (victim, peers)
    # fair: a request starts only when no tenant waiting has been served less than its tenant (so no
    # tenant's counter runs ahead of a waiting one's by more than the one request it starts)
    if policy == "fair":
        for seq, waiting, counters in admissions:
            if seq.num_preemptions == 0:
                least = min(counters.get(s.request.tenant, 0.0) for s in waiting)
                assert counters.get(seq.request.tenant, 0.0) == least, (seq, counters)
    # time limits: past its first-token limit without a token, a request ends with a queue timeout; past
    # its deadline with tokens, with "length"; nothing runs a step past either
    for i, (at, _, _, n, _, _, queue_s, deadline_s) in enumerate(workload):
        info = seen[f"r{i}"]
        if info.get("refused"):
            continue
        first_limit = min([s for s in (queue_s, server_queue_s, deadline_s) if s is not None], default=None)
        if QUEUE_TIMEOUT in info["kinds"]:
            assert "first" not in info and first_limit is not None
            assert info["finish"] == ["error"] * len(info["finish"])
        elif "first" in info and first_limit is not None:
            assert info["first"] <= at + first_limit + 2, info  # stamped and checked at steps: a turn or two late
        if deadline_s is not None and "last" in info:
            assert info["last"] <= at + deadline_s + 2, info
    # within a class (same priority; same relative limits under deadline; same tenant under fair), first
    # tokens of single samples follow arrival
    def cls(w):
        return (w[4] if with_priority else 0, min([s for s in (w[6], server_queue_s, w[7]) if s is not None],
                                                  default=None) if policy == "deadline" else None,
                w[5] if policy == "fair" else None)
    by_arrival = sorted(range(len(workload)), key=lambda i: (workload[i][0], i))
    for key in {cls(w) for w in workload}:
        members = [i for i in by_arrival if cls(workload[i]) == key and workload[i][3] == 1
                   and "first" in seen[f"r{i}"]]
        firsts = [seen[f"r{i}"]["first"] for i in members]
        assert firsts == sorted(firsts), (key, firsts)
    event(f"{policy}: preemptions {bool(preemptions)}, timeouts {any(QUEUE_TIMEOUT in v['kinds'] for v in seen.values())}")
