"""The engine session's decisions, as pure functions of what the replicas sent and the time: the
request table, replica choice, liveness and loss that the HTTP frontend and the offline LLM share
(client/engine_session.py). No sockets, no processes."""

from __future__ import annotations

import pytest

from pagedserve.client.engine_session import EngineSession, InFlight
from pagedserve.client.router import Router
from pagedserve.client.routing_policy import RoutingPolicy
from pagedserve.protocol.block_hash import prefix_block_hashes
from pagedserve.protocol.messages import PrefixCacheEvents, RequestDelta, SchedulerStats

TIMEOUT_S = 1.0
BS = 4
PROMPT = list(range(100, 117))  # four full blocks and one token


def stats(replica: int, state: str = "ready", pid: int = 0, **fields) -> SchedulerStats:
    return SchedulerStats(replica=replica, state=state, pid=pid or 100 + replica, block_size=BS,
                          num_gpu_blocks=64, **fields)


def session(num_replicas: int = 2, kind: str = "least-loaded", patient: bool = False, now: float = 10.0,
            **knobs) -> EngineSession:
    """Every replica's first stats arrived at ``now``."""
    s = EngineSession(Router(num_replicas, TIMEOUT_S, RoutingPolicy(kind, **knobs), patient=patient))
    for replica in range(num_replicas):
        s.on_stats(stats(replica), now)
    return s


def send(s: EngineSession, request_id: str, now: float = 10.0, num_seqs: int = 1, prompt=(), lora_name: str = ""):
    decision = s.choose(prompt, now)
    request = InFlight(request_id, decision.replica, num_seqs, decision.predicted_hit_tokens, lora_name)
    s.track(request)
    return request


def finish(request_id: str, index: int = 0, reason: str = "length", **fields) -> RequestDelta:
    return RequestDelta(request_id, index, [7], reason, **fields)


# ------------------------------------------------------------------ the request table


def test_a_requests_deltas_reach_its_record_until_every_sample_finished_then_it_is_forgotten():
    s = session(1)
    request = send(s, "a", num_seqs=2)
    assert s.on_delta(RequestDelta("a", 0, [5])) is request
    assert s.on_delta(finish("a", 0)) is request and not request.done
    assert s.router.replicas[0].in_flight == 2
    assert s.on_delta(finish("a", 1)) is request and request.done
    assert len(s) == 0 and s.router.replicas[0].in_flight == 0
    assert s.on_delta(RequestDelta("a", 1, [9])) is None  # a late delta belongs to nobody
    assert s.on_delta(RequestDelta("never-sent", 0, [9])) is None


def test_a_normal_finish_scores_the_routers_prediction_and_an_error_does_not():
    s = session(1)
    send(s, "ok").predicted_hit_tokens = 8
    send(s, "bad").predicted_hit_tokens = 8
    s.on_delta(finish("ok", num_cached_tokens=4))
    s.on_delta(finish("bad", reason="error", error="boom"))
    chooser = s.router.chooser
    assert (chooser.predicted_hit_tokens[0], chooser.actual_hit_tokens[0]) == (8, 4)


def test_forgetting_is_once_and_frees_the_replica_for_the_router():
    s = session(1)
    request = send(s, "a", num_seqs=3)
    s.forget(request)
    s.forget(request)
    assert request.done and len(s) == 0 and s.router.replicas[0].in_flight == 0


def test_the_adapter_in_use_is_counted_over_the_requests_in_flight():
    s = session(1)
    send(s, "a", lora_name="sql")
    send(s, "b", lora_name="sql")
    send(s, "c")
    assert (s.using_adapter("sql"), s.using_adapter("chat"), s.using_adapter("")) == (2, 0, 1)


# ------------------------------------------------------------------ choosing a replica


def test_round_robin_takes_the_replicas_in_turn():
    s = session(3, "round-robin")
    assert [send(s, f"r{i}").replica for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_loaded_spreads_a_batch_sent_before_any_stats_came_back():
    """The offline LLM's replicas after ProcessReady: heard from, no stats yet."""
    s = EngineSession(Router(2, TIMEOUT_S, RoutingPolicy("least-loaded"), patient=True))
    for replica in (0, 1):
        s.heard(replica, 10.0)
    replicas = [send(s, f"r{i}", num_seqs=2).replica for i in range(8)]
    assert replicas.count(0) == replicas.count(1) == 4
    assert [s.router.replicas[r].in_flight for r in (0, 1)] == [8, 8]


def test_cache_aware_sends_a_prompt_to_the_replica_its_prefix_is_cached_on():
    s = session(2, "cache-aware")
    s.on_cache_events(PrefixCacheEvents(1, 101, 0, False, prefix_block_hashes(PROMPT, BS), []))
    request = send(s, "a", prompt=PROMPT)
    assert (request.replica, request.predicted_hit_tokens) == (1, 16)


def test_no_replica_is_chosen_when_none_is_live_unless_the_client_has_nowhere_else_to_send():
    s = session(2)
    s.on_stats(stats(0, state="draining"), 10.0)
    assert s.choose((), now=10.5).replica == 1
    assert s.choose((), now=10.0 + TIMEOUT_S) is None  # replica 1 silent, replica 0 draining
    assert s.choose((), now=10.0 + TIMEOUT_S, even_if_none_live=True) is not None


# ------------------------------------------------------------------ liveness and loss


def test_a_silent_replica_loses_its_requests_once_and_the_others_keep_theirs():
    s = session(2, "round-robin")
    a, b = send(s, "a"), send(s, "b")
    s.on_stats(stats(1), 10.8)  # replica 1 keeps talking
    assert s.failed(now=10.0 + TIMEOUT_S * 0.9) == []
    (lost,) = s.failed(now=11.5)
    assert (lost.replica, lost.request_ids, lost.restarted) == (0, ["a"], False)
    assert "sent nothing for 1 s (replica_timeout_s)" in lost.reason
    assert a.done and not b.done and s.router.replicas[0].in_flight == 0
    assert s.failed(now=11.6) == []  # lost once
    assert s.silent_s(0, 11.5) == pytest.approx(1.5)


def test_a_sign_of_life_other_than_stats_keeps_a_replica_live():
    s = session(1)
    send(s, "a")
    s.heard(0, 10.9)  # the offline LLM counts outputs and the supervisor channel's heartbeats
    assert s.failed(now=11.5) == []


def test_a_replica_that_leaves_the_serving_states_loses_its_requests_and_gets_no_new_ones():
    s = session(2, "round-robin")
    send(s, "a"), send(s, "b")
    s.on_stats(stats(0, state="recovering"), 10.1)
    (lost,) = s.failed(now=10.2)
    assert lost.request_ids == ["a"] and "went to state 'recovering'" in lost.reason
    assert {send(s, f"n{i}", now=10.2).replica for i in range(3)} == {1}


def test_a_patient_client_keeps_its_requests_on_a_recovering_replica_and_still_sends_there():
    """The offline LLM replaces dead workers itself: their scheduler keeps its queue meanwhile."""
    s = session(1, patient=True)
    send(s, "a")
    s.on_stats(stats(0, state="recovering"), 10.1)
    assert s.failed(now=10.2) == [] and send(s, "b", now=10.2).replica == 0
    s.on_stats(stats(0, state="failed"), 10.3)
    assert sorted(s.failed(now=10.4)[0].request_ids) == ["a", "b"]


def test_stats_from_a_new_scheduler_process_lose_what_the_old_one_held_and_ask_for_the_adapters_again():
    s = session(2, "round-robin")
    send(s, "a"), send(s, "b")
    lost = s.on_stats(stats(0, pid=555), 10.2)
    assert (lost.replica, lost.request_ids, lost.restarted) == (0, ["a"], True)
    assert "restarted (pid 100 -> 555)" in lost.reason
    assert s.on_stats(stats(0, pid=555), 10.3) is None  # the same process again
    assert s.on_stats(stats(1, pid=777), 10.3).restarted  # none in flight there: still restarted
    assert s.on_stats(stats(5), 10.3) is None and not s.knows(5)  # an unknown replica changes nothing


def test_the_drain_deadline_ends_every_request_on_every_replica():
    s = session(2, "round-robin")
    requests = [send(s, f"r{i}") for i in range(3)]
    lost = s.lose_all("the server is shutting down")
    assert lost.requests == requests and all(r.done for r in requests) and len(s) == 0
    assert s.lose_all("again") is None
