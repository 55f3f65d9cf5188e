"""Bounded restarts with exponential backoff, per supervised unit (a replica or the frontend).

A unit may restart ``max_restarts`` times within any ``window_s`` seconds; the next
crash inside the window means it is broken (bad weights, a device gone, a bug that
fires on every start), and restarting it again would only flap. The first restart
is immediate; later ones in the same window wait 0.5 s, 1 s, 2 s, ... up to 10 s.
``RestartSchedule`` holds the units waiting out their backoff: the supervisor's replicas, the offline
LLM's workers (it plays the supervisor there).
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Optional

MAX_BACKOFF_S = 10.0


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float):
        if max_restarts < 0 or window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and the window positive")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: dict[Hashable, deque] = {}

    def restarts_in_window(self, unit: Hashable, now: float) -> int:
        times = self._times.setdefault(unit, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        return len(times)

    def next_delay(self, unit: Hashable, now: float) -> Optional[float]:
        """Seconds to wait before restarting ``unit`` (and the restart is counted), or None
        when its budget is spent and it must be marked failed instead."""
        used = self.restarts_in_window(unit, now)
        if used >= self.max_restarts:
            return None
        self._times[unit].append(now)
        return 0.0 if used == 0 else min(0.5 * 2 ** (used - 1), MAX_BACKOFF_S)


class RestartSchedule:
    """Units waiting to restart, each until its backoff ends: what to do about a crash (restart
    at once, later, or never: the budget is spent), apart from doing it."""

    def __init__(self, budget: RestartBudget):
        self.budget = budget
        self.num_restarts = 0  # restarts decided, over the whole run
        self._due: dict[Hashable, float] = {}

    def __contains__(self, unit: Hashable) -> bool:
        return unit in self._due

    def schedule(self, unit: Hashable, now: float) -> Optional[float]:
        """Seconds until ``unit`` restarts (the restart counted in its budget), or None when the
        budget is spent."""
        delay = self.budget.next_delay(unit, now)
        if delay is not None:
            self._due[unit] = now + delay
            self.num_restarts += 1
        return delay

    def take_due(self, now: float) -> list[Hashable]:
        """The units whose backoff has ended: restart them now (they are no longer waiting)."""
        due = [unit for unit, when in self._due.items() if now >= when]
        for unit in due:
            del self._due[unit]
        return due
