"""Warnings that a flood cannot turn into a flood of log lines.

A peer that sends 100,000 bad frames must cost a few log lines, not 100,000: the first
occurrence of a kind is logged at once, later ones within ``interval_s`` are counted and
summed up in one line when the interval has passed (at the next occurrence, or at
``flush()``). Every line carries the running total, so an operator (or a test) reads how
many there were from the last line alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class _Kind:
    total: int = 0
    suppressed: int = 0
    window_start: float = float("-inf")
    last_message: str = ""


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._kinds: dict[str, _Kind] = {}
        self._held_back = False  # any kind with suppressed lines: flush() is free otherwise

    def warning(self, kind: str, message: str, *args) -> None:
        """Log ``kind: message`` now, or count it if ``kind`` was logged within the interval."""
        state = self._kinds.setdefault(kind, _Kind())
        state.total += 1
        now = self.clock()
        if now - state.window_start < self.interval_s:
            state.suppressed += 1
            state.last_message = message % args if args else message
            self._held_back = True
            return
        self._emit(kind, state, message % args if args else message)
        state.window_start = now

    def flush(self) -> None:
        """Log the summaries held back for at least the interval (cheap when there are none:
        receivers call it after every good message and while idle)."""
        if not self._held_back:
            return
        now = self.clock()
        self._held_back = False
        for kind, state in self._kinds.items():
            if state.suppressed and now - state.window_start >= self.interval_s:
                self._emit(kind, state, f"last: {state.last_message}")
                state.window_start = now
            self._held_back |= state.suppressed > 0

    def total(self, kind: str) -> int:
        state = self._kinds.get(kind)
        return state.total if state is not None else 0

    def _emit(self, kind: str, state: _Kind, message: str) -> None:
        if state.suppressed:
            self.logger.warning("%s (%d total; %d more in the last %.0fs): %s", kind, state.total,
                                state.suppressed, self.interval_s, message)
        else:
            self.logger.warning("%s (%d total): %s", kind, state.total, message)
        state.suppressed = 0
