"""Replica health from SchedulerStats heartbeats, and routing across replicas (the engine
session's, ``engine_session.py``: the HTTP frontend's and the offline LLM's).

Each replica also has the router's view of its prefix cache (``cache_index.py``, kept by
``PrefixCacheEvents``); ``routing_policy.py`` decides between the live replicas.

Stats lag behind: a request sent a moment ago is not in any replica's counts yet, and one
that finished a moment ago still is. The frontend therefore also counts the sequences it
has in flight on each replica, and uses the larger of the two views (the stats' running
count only while no request finished there since they were sent), plus the waiting queue again (a queue means the replica is
out of room, not merely busy). KV-cache usage breaks ties, then the replica chosen least
recently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedserve.client.cache_index import ReplicaCacheIndex
from pagedserve.client.routing_policy import Decision, ReplicaChooser, RoutingPolicy
from pagedserve.protocol.messages import PrefixCacheEvents, ProcessTable, SchedulerStats

ROUTABLE_STATES = ("ready",)
SERVING_STATES = ("ready", "draining")  # in-flight requests may continue in these
# A client that replaces dead workers itself and waits for them (the offline LLM, with no other
# frontend to drain it) sends to a replica while its workers start, and its requests wait there.
PATIENT_STATES = ("starting", "ready", "recovering")


@dataclass(slots=True)
class ReplicaStatus:
    replica: int
    stats: Optional[SchedulerStats] = None
    last_seen: float = float("-inf")  # monotonic time it was last heard from (its stats, or what its client counts)
    released_at: float = 0.0  # monotonic time a request here last finished
    in_flight: int = 0  # sequences this frontend sent and has not seen finish
    request_ids: set[str] = field(default_factory=set)
    cache: ReplicaCacheIndex = field(init=False)

    def __post_init__(self) -> None:
        self.cache = ReplicaCacheIndex(self.replica)

    def is_fresh(self, now: float, timeout_s: float) -> bool:
        return now - self.last_seen < timeout_s

    def is_live(self, now: float, timeout_s: float, states: tuple[str, ...] = ROUTABLE_STATES) -> bool:
        # Heard from but no stats yet (the offline LLM's replicas just after ProcessReady): ready
        return self.is_fresh(now, timeout_s) and (self.stats is None or self.stats.state in states)

    def is_serving(self, now: float, timeout_s: float, states: tuple[str, ...] = SERVING_STATES) -> bool:
        return self.is_live(now, timeout_s, states)

    def num_waiting(self) -> int:
        """Requests waiting for a seat here: the stats' count, plus the requests sent since those
        stats that the stats' running count and seats cannot hold (not yet counted anywhere)."""
        s = self.stats
        if s is None:
            return 0
        unseen = self.in_flight - (s.num_running + s.num_waiting + s.num_swapped)
        return s.num_waiting + max(0, unseen) if s.num_waiting else 0

    def load(self, priority: Optional[int] = None) -> tuple[float, float, int]:
        """``priority``: of the request to place; under a policy that orders by priority, waiting
        requests of a worse priority are not ahead of it and do not count."""
        s = self.stats
        if s is None:  # only what was sent from here
            return self.in_flight, 0.0, self.replica
        # Stats older than a finish still count it: on a uniform workload trusting them
        # regardless sent 36 of 64 one-at-a-time requests to one replica.
        running = s.num_running if self.last_seen >= self.released_at else 0
        waiting = s.num_waiting
        if priority is not None and s.num_waiting_by_priority:
            waiting = sum(n for level, n in s.num_waiting_by_priority.items() if level <= priority)
        queued = running + waiting + s.num_swapped
        return (max(queued, self.in_flight - (s.num_waiting - waiting)) + waiting + s.num_swapped,
                s.kv_cache_usage, self.replica)


class Router:
    def __init__(self, num_replicas: int, timeout_s: float, policy: Optional[RoutingPolicy] = None,
                 patient: bool = False):
        """``patient``: routes to and keeps requests on replicas in PATIENT_STATES (the offline LLM)."""
        self.timeout_s = timeout_s
        self.routable_states = PATIENT_STATES if patient else ROUTABLE_STATES
        self.serving_states = PATIENT_STATES if patient else SERVING_STATES
        # What "now" is for a replica's freshness: the frontend's receiver sets the last time it
        # had read every stats frame sent to it, so a stall of this process's own loop (a long
        # request's preparation) never makes a replica that kept sending look silent.
        self.clock: Callable[[], float] = time.monotonic
        self.replicas = [ReplicaStatus(r) for r in range(num_replicas)]
        self.chooser = ReplicaChooser(policy or RoutingPolicy(), num_replicas)
        self.processes: Optional[ProcessTable] = None  # the supervisor's latest view

    def update(self, stats: SchedulerStats, now: Optional[float] = None) -> bool:
        """Record a heartbeat; False (and ignored) for a replica index out of range."""
        if not 0 <= stats.replica < len(self.replicas):
            return False
        status = self.replicas[stats.replica]
        status.stats = stats
        status.last_seen = time.monotonic() if now is None else now
        status.cache.check(stats)
        return True

    def heard(self, replica: int, now: float) -> None:
        """A sign of life other than stats (the offline LLM counts its outputs and the supervisor
        channel's heartbeats); ignored for a replica index out of range."""
        if 0 <= replica < len(self.replicas):
            self.replicas[replica].last_seen = now

    def apply_cache_events(self, events: PrefixCacheEvents) -> bool:
        """Update a replica's cache view; False (and ignored) for a replica index out of range."""
        if not 0 <= events.replica < len(self.replicas):
            return False
        self.replicas[events.replica].cache.apply(events)
        return True

    def _live(self, now: Optional[float]) -> list[ReplicaStatus]:
        now = self.clock() if now is None else now
        return [r for r in self.replicas if r.is_live(now, self.timeout_s, self.routable_states)]

    def choose(self, prompt_token_ids=(), now: Optional[float] = None,
               priority: Optional[int] = None, seed: int = 0, even_if_none_live: bool = False) -> Optional[Decision]:
        """Where a request with this prompt (and priority) goes (and why), or None when no replica is live.
        ``seed``: its LoRA adapter's ``adapter_seed`` (0: the base model), the first block's parent.
        ``even_if_none_live``: then among every replica (a client with nowhere else to send)."""
        live = self._live(now) or (self.replicas if even_if_none_live else [])
        return self.chooser.choose(live, prompt_token_ids, priority, seed) if live else None

    def pick(self, now: Optional[float] = None) -> Optional[int]:
        """The least-loaded live replica, or None when none is live (no decision is recorded)."""
        live = self._live(now)
        return min(live, key=ReplicaStatus.load).replica if live else None

    def with_room(self, chosen: int, limit: int, now: Optional[float] = None) -> Optional[int]:
        """--max-waiting-requests across the router: ``chosen`` while fewer than ``limit`` wait there,
        else the live replica with the fewest waiting if it has room; None when every one is full."""
        if self.replicas[chosen].num_waiting() < limit:
            return chosen
        live = self._live(now)
        best = min(live, key=lambda r: (r.num_waiting(), r.replica)) if live else None
        return best.replica if best is not None and best.num_waiting() < limit else None

    def every_live_full(self, limit: int, now: Optional[float] = None) -> bool:
        """True when some replica is live and every live one has ``limit`` or more waiting: what
        ``with_room`` answers None to, whichever replica a request would be routed to."""
        now = self.clock() if now is None else now
        live = False
        for r in self.replicas:
            if r.is_live(now, self.timeout_s, self.routable_states):
                if r.num_waiting() < limit:
                    return False
                live = True
        return live

    def assign(self, replica: int, request_id: str, num_seqs: int) -> None:
        status = self.replicas[replica]
        status.request_ids.add(request_id)
        status.in_flight += num_seqs

    def release(self, replica: int, request_id: str, num_seqs: int, now: Optional[float] = None) -> None:
        status = self.replicas[replica]
        status.released_at = time.monotonic() if now is None else now
        if request_id in status.request_ids:
            status.request_ids.discard(request_id)
            status.in_flight = max(0, status.in_flight - num_seqs)

    def failed_replicas(self, now: Optional[float] = None) -> list[ReplicaStatus]:
        """Replicas with requests in flight that can no longer serve them."""
        now = self.clock() if now is None else now
        return [r for r in self.replicas
                if r.request_ids and not r.is_serving(now, self.timeout_s, self.serving_states)]

    def any_live(self, now: Optional[float] = None) -> bool:
        return bool(self._live(now))

    def describe(self, now: Optional[float] = None) -> list[dict[str, Any]]:
        """Per-replica health, for /health."""
        now = self.clock() if now is None else now
        table = self.processes
        out = []
        for r in self.replicas:
            s = r.stats
            fresh = s is not None and r.is_fresh(now, self.timeout_s)
            out.append({
                "replica": r.replica,
                "state": (s.state if fresh else "unresponsive") if s else "unknown",
                "live": r.is_live(now, self.timeout_s, self.routable_states),
                "num_running": s.num_running if s else 0,
                "num_waiting": s.num_waiting if s else 0,
                "num_swapped": s.num_swapped if s else 0,
                "scheduling_policy": s.scheduling_policy if s else None,
                "num_waiting_by_priority": dict(s.num_waiting_by_priority) if s else {},
                "num_running_by_priority": dict(s.num_running_by_priority) if s else {},
                "num_waiting_by_tenant": dict(s.num_waiting_by_tenant) if s else {},
                "num_running_by_tenant": dict(s.num_running_by_tenant) if s else {},
                "deadline_misses": s.num_queue_time_expired + s.num_deadline_expired if s else 0,
                "kv_cache_usage": s.kv_cache_usage if s else 0.0,
                "num_gpu_blocks": s.num_gpu_blocks if s else 0,
                "num_free_gpu_blocks": s.num_free_gpu_blocks if s else 0,
                "in_flight": r.in_flight,
                "cached_blocks_known": len(r.cache),
                "seconds_since_stats": round(now - r.last_seen, 3) if s else None,
                "worker_restarts": s.worker_restarts if s else 0,
                "restarts_in_window": (table.replica_restarts[r.replica]
                                       if table and r.replica < len(table.replica_restarts) else 0),
                "node_id": next((p.node for p in table.processes if p.replica == r.replica and p.node),
                                None) if table else None,
                "processes": [] if table is None else [
                    {"role": p.role, "rank": p.rank, "pid": p.pid, "alive": p.alive,
                     **({"node_id": p.node} if p.node else {})}
                    for p in table.processes if p.replica == r.replica],
            })
        return out

    def describe_deployment(self) -> dict[str, Any]:
        """The processes outside any replica (supervisor, frontend), for /health."""
        table = self.processes
        if table is None:
            return {}
        others = [{"role": p.role, "pid": p.pid, "alive": p.alive}
                  for p in table.processes if not 0 <= p.replica < len(self.replicas)]
        return {"supervisor_pid": table.supervisor_pid, "processes": others,
                "failed_replicas": list(table.failed_replicas)}
