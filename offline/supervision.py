"""The offline LLM as its engine's supervisor: what ``serve``'s supervisor does about dead or hung
processes, done by the LLM, which has no other. The requests' side (replica choice, a silent
replica's lost requests) is the engine session's, as for the HTTP frontend
(``client/engine_session.py``).

- A scheduler that exited, or is silent for ``scheduler_timeout_s`` (hung), ends the LLM with
  EngineDiedError. The supervisor would restart it; the LLM restarts no scheduler, so it kills a
  hung one (the next call then finds it exited, at once).
- Dead workers are replaced within serve's budget (``deploy/restart_policy.py``): at most
  ``max_restarts`` within ``restart_window_s``, after its backoff. Their scheduler already ended
  their requests with an error and waits for the new ones.

Nothing reads the processes between two calls; what they sent meanwhile waits in the sockets, and
each call's first look receives it, so silence is never counted from before an idle gap.
"""

from __future__ import annotations

from typing import Iterable

from pagedserve.client.engine_session import EngineSession
from pagedserve.deploy.launcher import Launcher
from pagedserve.deploy.restart_policy import RestartBudget, RestartSchedule
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.protocol import messages as m


class EngineDiedError(RuntimeError):
    """A scheduler exited or hung, or workers kept dying, while the LLM was using them."""


class Supervision:
    def __init__(self, config: ServeConfig, launcher: Launcher, session: EngineSession):
        self.config, self.launcher, self.session = config, launcher, session
        self.restarts = RestartSchedule(RestartBudget(config.max_restarts, config.restart_window_s))

    @property
    def worker_restarts(self) -> int:
        return self.restarts.num_restarts

    def watch(self, control: Iterable[object], now: float) -> None:
        """``control``: what arrived on the supervisor's socket. Raises EngineDiedError for a
        scheduler that exited or hung, or workers past their restart budget."""
        for msg in control:
            if isinstance(msg, m.Heartbeat):
                self.session.heard(msg.replica, now)
            elif isinstance(msg, m.RestartWorkers) and self.session.knows(msg.replica):
                self._restart_workers(msg.replica, msg.reason, now)
        for replica, child in self.launcher.schedulers.items():
            if child.popen.poll() is not None:
                raise EngineDiedError(f"{child.name} exited with code {child.popen.returncode}")
            silent_s = self.session.silent_s(replica, now)
            if silent_s > self.config.scheduler_timeout_s:
                child.kill()
                raise EngineDiedError(f"{child.name} alive but silent for {silent_s:.1f}s (hung: "
                                      f"scheduler_timeout_s={self.config.scheduler_timeout_s:g})")
        for replica in list(self.launcher.workers):
            dead = None if replica in self.restarts else self.launcher.unreported_dead_worker(replica, now)
            if dead is not None:
                self._restart_workers(replica, f"{dead.name} exited", now)
        for replica in self.restarts.take_due(now):
            self.launcher.spawn_workers(replica)

    def _restart_workers(self, replica: int, reason: str, now: float) -> None:
        if replica in self.restarts:
            return
        if self.restarts.schedule(replica, now) is None:
            raise EngineDiedError(f"workers of replica {replica} died more than max_restarts="
                                  f"{self.config.max_restarts} times within restart_window_s="
                                  f"{self.config.restart_window_s:g} (last: {reason}); giving up")
        for child in self.launcher.workers.get(replica, []):
            child.kill()
        self.launcher.forget_dead_workers(replica)
