"""One engine session: what every client of the scheduler replicas decides, with no I/O.

The HTTP frontend (``frontend_proc/engine_client.py``: asyncio sockets, a request's inbox) and
the offline ``LLM`` (``offline/llm.py``: blocking sockets and the processes it started) both
drive this object: they hand it what arrived and the time, and act on what it answers (send the
request there, end these requests, resend the adapters). It owns, and is the one writer of:

- the request table: request id -> ``InFlight`` (its replica, sequences, adapter, the cache hits
  the router predicted). A client's own record of a request subclasses ``InFlight``, so the table
  hands back the object a delta is for, with nothing to look up a second time;
- the replicas' liveness and the choice among them (``router.py``, ``routing_policy.py``);
- the decisions on loss: a replica that left the serving states, fell silent for the router's
  timeout, or came back as a new scheduler process (its pid changed: it knows none of them) loses
  its requests. They are returned as ``Lost``, already forgotten; the client ends them with the
  reason and aborts them on the replica (fire and forget: a replica that comes back frees them).

Restarting dead workers is the supervisor's, or the offline LLM's that plays it
(``deploy/restart_policy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagedserve.client.routing_policy import Decision
from pagedserve.client.router import Router
from pagedserve.protocol.messages import PrefixCacheEvents, RequestDelta, SchedulerStats


@dataclass(slots=True, eq=False)
class InFlight:
    """A request sent to a replica and not yet over, as the session tracks it."""

    request_id: str
    replica: int
    num_seqs: int
    predicted_hit_tokens: int = 0  # what the router expected the replica to have cached
    lora_name: str = ""  # the adapter computing it ("": the base model)
    finished_indexes: set[int] = field(default_factory=set)
    done: bool = False  # the scheduler holds nothing more for it (or the client stopped listening)


@dataclass(frozen=True, slots=True)
class Lost:
    """A replica's requests that will never finish there, and why (what their clients are told)."""

    replica: int
    reason: str
    requests: list  # the InFlight records, forgotten
    restarted: bool = False  # a new scheduler process: it needs the session's state again (adapters)

    @property
    def request_ids(self) -> list[str]:
        return [request.request_id for request in self.requests]


class EngineSession:
    def __init__(self, router: Router):
        self.router = router
        self._requests: dict[str, InFlight] = {}  # written here only, as the router's in-flight counts

    def __len__(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ placing requests

    def choose(self, prompt_token_ids: Sequence[int] = (), now: Optional[float] = None,
               priority: Optional[int] = None, seed: int = 0, even_if_none_live: bool = False) -> Optional[Decision]:
        """The replica for a request (``router.choose``), or None when no replica is live. The offline
        LLM, with no other frontend to send to, sends ``even_if_none_live``: the requests are then
        lost at the next ``failed`` unless the replica is heard from again."""
        return self.router.choose(prompt_token_ids, now, priority, seed, even_if_none_live)

    def track(self, request: InFlight) -> None:
        """``request`` was sent to ``request.replica``: its deltas are now expected."""
        self._requests[request.request_id] = request
        self.router.assign(request.replica, request.request_id, request.num_seqs)

    def forget(self, request: InFlight, now: Optional[float] = None) -> None:
        """The client is done with ``request`` (aborted, ended by a stop string, or lost)."""
        if request.done:
            return
        request.done = True
        self._requests.pop(request.request_id, None)
        self.router.release(request.replica, request.request_id, request.num_seqs, now)

    def using_adapter(self, lora_name: str) -> int:
        """How many requests in flight an adapter computes."""
        return sum(1 for request in self._requests.values() if request.lora_name == lora_name)

    # ------------------------------------------------------------------ what the replicas send

    def on_delta(self, delta: RequestDelta) -> Optional[InFlight]:
        """The request ``delta`` is for, or None (unknown, or already over). Once every sequence
        finished the request is forgotten, and a normal finish scores the router's prediction."""
        request = self._requests.get(delta.request_id)
        if request is None or delta.finish_reason is None:
            return request
        request.finished_indexes.add(delta.index)
        if len(request.finished_indexes) >= request.num_seqs:
            if delta.error is None:  # prediction vs the hits the replica reports
                self.router.chooser.record_finished(request.replica, request.predicted_hit_tokens,
                                                    delta.num_cached_tokens)
            self.forget(request)
        return request

    def knows(self, replica: int) -> bool:
        return 0 <= replica < len(self.router.replicas)

    def on_stats(self, stats: SchedulerStats, now: Optional[float] = None) -> Optional[Lost]:
        """A replica's heartbeat. From a new scheduler process (another pid than the last stats'),
        the requests sent to the old one are lost: returned, with ``restarted`` set."""
        lost = None
        if self.knows(stats.replica) and stats.pid:
            last = self.router.replicas[stats.replica].stats
            if last is not None and last.pid and last.pid != stats.pid:
                lost = self._lose(stats.replica, f"scheduler replica {stats.replica} was restarted "
                                                 f"(pid {last.pid} -> {stats.pid})", now, restarted=True)
        self.router.update(stats, now)
        return lost

    def on_cache_events(self, events: PrefixCacheEvents) -> bool:
        """A replica's prefix-cache changes for the cache-aware router; False for an unknown replica."""
        return self.router.apply_cache_events(events)

    def heard(self, replica: int, now: float) -> None:
        """A sign of life other than stats (what the offline LLM counts)."""
        self.router.heard(replica, now)

    def silent_s(self, replica: int, now: float) -> float:
        """Seconds since ``replica`` was last heard from."""
        return now - self.router.replicas[replica].last_seen

    # ------------------------------------------------------------------ loss

    def failed(self, now: Optional[float] = None) -> list[Lost]:
        """The requests of every replica that can no longer serve them: it fell silent for the
        router's timeout, or left the serving states (a fault, or the drain of another frontend)."""
        now = self.router.clock() if now is None else now
        return [lost for status in self.router.failed_replicas(now)
                if (lost := self._lose(status.replica, self._why_failed(status.replica, now), now)) is not None]

    def _why_failed(self, replica: int, now: float) -> str:
        status = self.router.replicas[replica]
        if status.stats is not None and status.is_fresh(now, self.router.timeout_s):
            return f"scheduler replica {replica} went to state {status.stats.state!r}"
        return f"scheduler replica {replica} sent nothing for {self.router.timeout_s:g} s (replica_timeout_s)"

    def lose_all(self, reason: str) -> Optional[Lost]:
        """Every request in flight, on whichever replica (the drain deadline): forgotten, returned
        as one ``Lost`` whose ``replica`` is -1 (each request keeps its own)."""
        requests = list(self._requests.values())
        for request in requests:
            self.forget(request)
        return Lost(-1, reason, requests) if requests else None

    def _lose(self, replica: int, reason: str, now: Optional[float], restarted: bool = False) -> Optional[Lost]:
        requests = []
        for request_id in sorted(self.router.replicas[replica].request_ids):
            request = self._requests.get(request_id)
            if request is None:  # assigned on the router alone: nothing else to undo
                self.router.release(replica, request_id, 0, now)
                continue
            self.forget(request, now)
            requests.append(request)
        if not requests and not restarted:
            return None
        return Lost(replica, reason, requests, restarted)
