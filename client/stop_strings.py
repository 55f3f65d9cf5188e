"""Stop-string matching over streamed text, holding back what could still become a stop.

OpenAI semantics: the output ends just before the earliest stop string and the stop
string itself is not returned. While streaming, the last len(longest stop) - 1 characters
stay held back, so a stop string is never partially emitted. Any match that appears
later must start at or after the held-back boundary (it ends in text that is new), so
only the held-back text needs searching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(slots=True)
class StopCheck:
    text: str  # safe to emit now
    matched: Optional[str] = None  # the stop string that ended the output, if any


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._pending = ""  # received, not yet emitted
        self.matched: Optional[str] = None

    def feed(self, new_text: str) -> StopCheck:
        """Add newly detokenized text; return what may be emitted and any match."""
        if self.matched is not None:
            return StopCheck("", self.matched)
        self._pending += new_text
        match_at, matched = self._earliest_match()
        if matched is not None:
            self.matched = matched
            emit, self._pending = self._pending[:match_at], ""
            return StopCheck(emit, matched)
        cut = max(0, len(self._pending) - self._hold)
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        return StopCheck(emit)

    def pass_through(self, new_text: str) -> str:
        """``new_text`` and what is held back, emitted unsearched: text before min_tokens, where
        no stop string may end the output (and none that began there may end it later)."""
        if self.matched is not None:
            return ""
        emit, self._pending = self._pending + new_text, ""
        return emit

    def flush(self) -> str:
        """The held-back tail, at the end of a sequence that ended for another reason."""
        if self.matched is not None:
            return ""
        emit, self._pending = self._pending, ""
        return emit

    def _earliest_match(self) -> tuple[int, Optional[str]]:
        best_at, best = len(self._pending) + 1, None
        for stop in self.stop_strings:
            at = self._pending.find(stop)
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best
