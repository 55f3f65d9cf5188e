"""Cache-aware routing, as pure objects: the scheduler's cache events, the router's view of each
replica's cache, and the choice between replicas."""

from __future__ import annotations

import random

import pytest

from pagedserve.client.cache_index import ReplicaCacheIndex
from pagedserve.client.router import Router
from pagedserve.client.routing_policy import RoutingPolicy
from pagedserve.protocol.block_hash import prefix_block_hashes
from pagedserve.protocol.messages import PrefixCacheEvents, SchedulerStats
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, counting_tokens, request, run_until_done

BS = 4
SYSTEM = list(range(100, 116))  # four full blocks


def _events(seq, stored=(), removed=(), pid=7, replica=0, reset=False):
    return PrefixCacheEvents(replica, pid, seq, reset, list(stored), list(removed))


def _stats(replica=0, pid=7, sent=0, **fields):
    return SchedulerStats(replica=replica, state=fields.pop("state", "ready"), pid=pid, block_size=BS,
                          num_gpu_blocks=fields.pop("num_gpu_blocks", 64), cache_events_sent=sent, **fields)


def _drain_into(sched: Scheduler, index: ReplicaCacheIndex, pid=7) -> None:
    drained = sched.cache_events.drain()
    if drained is not None:
        seq, reset, stored, removed = drained
        index.apply(PrefixCacheEvents(0, pid, seq, reset, stored, removed))


# ------------------------------------------------------------------ the scheduler's events


def test_the_routers_view_equals_the_schedulers_cache_through_hits_and_evictions():
    config = SchedulerConfig(block_size=BS, num_gpu_blocks=24, enable_prefix_caching=True, debug_invariants=True)
    sched, worker = Scheduler(config), SimWorker(config, counting_tokens())
    index = ReplicaCacheIndex(0)
    rng = random.Random(3)
    for i in range(30):  # shared and fresh prefixes, in a cache small enough to evict often
        prompt = (SYSTEM[:rng.choice([0, 8, 16])] + [rng.randrange(1, 90) for _ in range(rng.randint(1, 14))])
        sched.add_request(request(f"r{i}", prompt, max_tokens=rng.randint(1, 6)))
        if i % 3 == 2:
            run_until_done(sched, worker)
        _drain_into(sched, index)
        assert set(index.blocks) == {key[2] for key in sched.bm.device.cache}
    assert len(index) > 0


def test_a_fresh_cache_after_the_workers_failed_tells_the_router_to_forget():
    config = SchedulerConfig(block_size=BS, num_gpu_blocks=16, enable_prefix_caching=True)
    sched, worker = Scheduler(config), SimWorker(config, counting_tokens())
    index = ReplicaCacheIndex(0)
    sched.add_request(request("a", SYSTEM + [1], max_tokens=2))
    run_until_done(sched, worker)
    _drain_into(sched, index)
    assert index.cached_prefix_blocks(prefix_block_hashes(SYSTEM + [2], BS)) == 4
    sched.fail_all("workers died")
    _drain_into(sched, index)
    assert len(index) == 0


def test_without_prefix_caching_the_router_hears_of_no_block():
    config = SchedulerConfig(block_size=BS, num_gpu_blocks=16)
    sched, worker = Scheduler(config), SimWorker(config, counting_tokens())
    for rid in ("a", "b"):  # b's prompt repeats a's, whose blocks filled while it ran
        sched.add_request(request(rid, SYSTEM + [1], max_tokens=6))
        run_until_done(sched, worker)
    index = ReplicaCacheIndex(0)
    _drain_into(sched, index)
    assert len(index) == 0 and sched.stats()["prefix_cache_hits"] == 0


# ------------------------------------------------------------------ the router's view


def test_a_prompt_matches_only_its_leading_cached_blocks_and_never_its_last_token():
    index = ReplicaCacheIndex(0)
    index.apply(_events(0, stored=prefix_block_hashes(SYSTEM + [1], BS)))
    assert index.cached_prefix_blocks(prefix_block_hashes(SYSTEM + [9, 9], BS)) == 4
    assert index.cached_prefix_blocks(prefix_block_hashes(SYSTEM[:8] + [0] * 9, BS)) == 2
    assert index.cached_prefix_blocks(prefix_block_hashes([0] + SYSTEM, BS)) == 0  # same blocks, other parents
    assert len(prefix_block_hashes(SYSTEM, BS)) == 3  # a hit never covers the last token


def test_evicted_blocks_end_the_match_there():
    index = ReplicaCacheIndex(0)
    hashes = prefix_block_hashes(SYSTEM + [1], BS)
    index.apply(_events(0, stored=hashes))
    index.apply(_events(1, removed=[hashes[2]]))
    assert index.cached_prefix_blocks(hashes) == 2


def test_the_view_never_holds_more_blocks_than_the_replica_has_keeping_the_newest():
    index = ReplicaCacheIndex(0)
    index.check(_stats(num_gpu_blocks=3))
    index.apply(_events(0, stored=[1, 2, 3, 4, 5]))
    assert sorted(index.blocks) == [3, 4, 5]


@pytest.mark.parametrize("trouble", ["gap", "stats_count", "new_pid", "reset"])
def test_anything_that_could_make_the_view_wrong_drops_it(trouble):
    index = ReplicaCacheIndex(0)
    index.check(_stats(sent=0))
    index.apply(_events(0, stored=[11, 12]))
    index.check(_stats(sent=1))
    assert len(index) == 2
    if trouble == "gap":
        index.apply(_events(2, stored=[13]))  # message 1 was lost
        assert list(index.blocks) == [13]
    elif trouble == "stats_count":
        index.check(_stats(sent=2))  # a message was sent that never arrived
        assert len(index) == 0
        index.apply(_events(2, stored=[14]))  # and the next one is accepted
        assert list(index.blocks) == [14]
    elif trouble == "new_pid":
        index.check(_stats(pid=8, sent=0))
        assert len(index) == 0
    else:
        index.apply(_events(1, stored=[15], reset=True))
        assert list(index.blocks) == [15]


# ------------------------------------------------------------------ choosing a replica


def _router(policy="cache-aware", num_replicas=2, **knobs) -> Router:
    router = Router(num_replicas, timeout_s=1.0, policy=RoutingPolicy(policy, **knobs))
    for r in range(num_replicas):
        router.update(_stats(replica=r, pid=100 + r), now=10.0)
    return router


def _cache(router: Router, replica: int, prompt: list[int]) -> None:
    index = router.replicas[replica].cache
    router.apply_cache_events(_events(index.next_seq, prefix_block_hashes(prompt, BS), pid=100 + replica,
                                      replica=replica))


def test_a_request_goes_to_the_replica_holding_its_longest_prefix():
    router = _router()
    _cache(router, 0, SYSTEM[:8] + [1])
    _cache(router, 1, SYSTEM + [1])
    decision = router.choose(SYSTEM + [5, 6], now=10.1)
    assert (decision.replica, decision.reason, decision.predicted_hit_tokens) == (1, "cache_hit", 16)


def test_the_cache_winner_is_skipped_when_it_is_busier_than_the_load_bound():
    router = _router(balance_abs=2, balance_rel=1.5)
    _cache(router, 1, SYSTEM + [1])
    router.assign(1, "x", 2)
    assert router.choose(SYSTEM + [5], now=10.1).replica == 1  # 2 more than replica 0: within the bound
    router.assign(1, "y", 1)
    decision = router.choose(SYSTEM + [5], now=10.1)
    assert (decision.replica, decision.reason) == (0, "load_bound")


def test_a_prefix_hot_everywhere_is_spread_by_load():
    router = _router(num_replicas=3)
    for r in range(3):
        _cache(router, r, SYSTEM + [1])
    counts = [0, 0, 0]
    for i in range(30):
        decision = router.choose(SYSTEM + [i], now=10.1)
        assert decision.reason == "cache_hit"
        router.assign(decision.replica, f"r{i}", 1)
        counts[decision.replica] += 1
    assert counts == [10, 10, 10]


def test_a_replica_that_is_down_or_restarted_is_not_chosen_for_its_cache():
    router = _router()
    _cache(router, 1, SYSTEM + [1])
    router.assign(0, "busy", 1)
    router.update(_stats(replica=0, pid=100), now=10.8)
    assert router.choose(SYSTEM + [2], now=11.5).replica == 0  # replica 1's stats are too old
    router.update(_stats(replica=1, pid=555), now=11.5)  # back, as a new scheduler process
    decision = router.choose(SYSTEM + [2], now=11.6)
    assert decision.reason == "no_hit" and len(router.replicas[1].cache) == 0


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin", "cache-aware"])
def test_one_request_at_a_time_still_alternates_between_idle_replicas(policy):
    router = _router(policy)
    picks = [router.choose([i, i + 1], now=10.1).replica for i in range(6)]
    assert picks == [0, 1, 0, 1, 0, 1]


def test_least_loaded_and_round_robin_ignore_the_cache():
    for policy, reason in (("least-loaded", "least_loaded"), ("round-robin", "round_robin")):
        router = _router(policy)
        _cache(router, 1, SYSTEM + [1])
        router.assign(1, "busy", 1)
        decision = router.choose(SYSTEM + [2], now=10.1)
        assert (decision.replica, decision.reason) == (0, reason)


def test_stats_sent_before_a_request_finished_no_longer_count_it():
    router = _router("least-loaded")
    router.update(_stats(replica=0, pid=100, num_running=1), now=10.0)
    router.assign(0, "a", 1)
    router.release(0, "a", 1, now=10.2)
    assert router.choose([1, 2], now=10.3).replica == 0  # both idle: the stats' running 1 is stale


def test_shedding_sends_a_request_to_a_replica_with_room_and_refuses_only_when_all_are_full():
    router = _router(num_replicas=3)
    for r, waiting in enumerate((4, 1, 4)):
        router.update(_stats(replica=r, pid=100 + r, num_running=2, num_waiting=waiting), now=10.0)
    assert router.with_room(0, limit=4, now=10.5) == 1  # replica 0 is full; 1 has room
    assert router.with_room(1, limit=4, now=10.5) == 1
    router.update(_stats(replica=1, pid=101, num_running=2, num_waiting=4), now=10.0)
    assert router.with_room(0, limit=4, now=10.5) is None  # every replica is at the limit: a 429
    assert router.with_room(0, limit=5, now=10.5) == 0


def test_the_load_view_counts_only_the_waiting_requests_that_run_before_the_one_placed():
    router = _router(policy="least-loaded")
    router.update(_stats(replica=0, pid=100, num_running=4, num_waiting=10, num_waiting_by_priority={5: 10}), now=10.0)
    router.update(_stats(replica=1, pid=101, num_running=4, num_waiting=3, num_waiting_by_priority={0: 3}), now=10.0)
    assert router.choose(now=10.5, priority=0).replica == 0  # nothing there runs before it
    assert router.choose(now=10.5, priority=5).replica == 1
    assert router.choose(now=10.5).replica == 1  # no priority: every waiting request counts
