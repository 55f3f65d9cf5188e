"""The offline LLM's watch over its replicas: what ``serve``'s supervisor and HTTP frontend do
about a replica that dies or falls silent, done by the LLM, which plays both.

- A replica is heard from by every SchedulerStats, RequestOutputs or Heartbeat it sends. One
  silent for ``replica_timeout_s`` loses the requests waiting on it (they end with finish_reason
  "error", as the HTTP frontend fails them) and gets no new ones while another was heard from.
- A scheduler silent for ``scheduler_timeout_s`` is hung. The supervisor would restart it; the
  LLM restarts no scheduler, so it kills it and raises EngineDiedError, as for one that exited.
- Dead workers are replaced within serve's budget (deploy/restart_policy.py): at most
  ``max_restarts`` within ``restart_window_s``, after its backoff.

Nothing reads the replicas between two calls; what they sent meanwhile waits in the sockets, and
each call's first look receives it, so silence is never counted from before an idle gap.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable

from pagedserve.deploy.launcher import Launcher
from pagedserve.deploy.restart_policy import RestartBudget
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.protocol import messages as m


class EngineDiedError(RuntimeError):
    """A scheduler exited or hung, or workers kept dying, while the LLM was using them."""


class Replicas:
    def __init__(self, config: ServeConfig, launcher: Launcher):
        self.config, self.launcher = config, launcher
        self.count = config.data_parallel_size
        self.in_flight = [0] * self.count
        now = time.monotonic()
        self.last_heard = [now] * self.count
        self.budget = RestartBudget(config.max_restarts, config.restart_window_s)
        self.respawn_at: dict[int, float] = {}  # replica -> when its killed workers start again
        self.worker_restarts = 0
        self._turns = itertools.count()

    def heard(self, replica: int, now: float) -> None:
        if 0 <= replica < self.count:
            self.last_heard[replica] = now

    def silent(self, now: float) -> list[int]:
        """Replicas past ``replica_timeout_s`` without a word: their requests are lost."""
        return [r for r in range(self.count) if now - self.last_heard[r] > self.config.replica_timeout_s]

    def lost(self, pending: dict, now: float) -> dict[str, m.RequestDelta]:
        """The requests in ``pending`` waiting on a silent replica, each with the delta that ends
        it as the HTTP frontend ends them."""
        silent = self.silent(now)
        return {rid: m.RequestDelta(rid, 0, [], "error", error_kind="engine",
                                    error=f"scheduler replica {request.replica} sent nothing for "
                                          f"{self.config.replica_timeout_s:g}s (replica_timeout_s); "
                                          f"the request was lost")
                for rid, request in pending.items() if request.replica in silent}

    def pick(self, now: float) -> int:
        """The next request's replica, by the LLM's ``router``, among those heard from lately."""
        silent = self.silent(now)
        candidates = [r for r in range(self.count) if r not in silent] or list(range(self.count))
        if self.config.router == "round-robin":
            replica = candidates[next(self._turns) % len(candidates)]
        else:
            replica = min(candidates, key=self.in_flight.__getitem__)
        self.in_flight[replica] += 1
        return replica

    def watch(self, control: Iterable[object], now: float) -> None:
        """``control``: what arrived on the supervisor's socket. Raises EngineDiedError for a
        scheduler that exited or hung, or workers past their restart budget."""
        for msg in control:
            if isinstance(msg, m.Heartbeat):
                self.heard(msg.replica, now)
            elif isinstance(msg, m.RestartWorkers) and 0 <= msg.replica < self.count:
                self._restart_workers(msg.replica, msg.reason, now)
        for replica, child in self.launcher.schedulers.items():
            if child.popen.poll() is not None:
                raise EngineDiedError(f"{child.name} exited with code {child.popen.returncode}")
            silent_s = now - self.last_heard[replica]
            if silent_s > self.config.scheduler_timeout_s:
                child.kill()  # a later call then finds it exited, at once
                raise EngineDiedError(f"{child.name} alive but silent for {silent_s:.1f}s (hung: "
                                      f"scheduler_timeout_s={self.config.scheduler_timeout_s:g})")
        for replica in list(self.launcher.workers):
            dead = None if replica in self.respawn_at else self.launcher.unreported_dead_worker(replica, now)
            if dead is not None:
                self._restart_workers(replica, f"{dead.name} exited", now)
        for replica, when in list(self.respawn_at.items()):
            if now >= when:
                del self.respawn_at[replica]
                self.launcher.spawn_workers(replica)

    def _restart_workers(self, replica: int, reason: str, now: float) -> None:
        """What the supervisor does for ``serve``: the replica's workers are replaced; its
        scheduler already ended their requests with an error and waits for the new ones."""
        if replica in self.respawn_at:
            return
        delay = self.budget.next_delay(replica, now)
        if delay is None:
            raise EngineDiedError(f"workers of replica {replica} died more than max_restarts="
                                  f"{self.config.max_restarts} times within restart_window_s="
                                  f"{self.config.restart_window_s:g} (last: {reason}); giving up")
        self.worker_restarts += 1
        for child in self.launcher.workers.get(replica, []):
            child.kill()
        self.launcher.forget_dead_workers(replica)
        self.respawn_at[replica] = now + delay
