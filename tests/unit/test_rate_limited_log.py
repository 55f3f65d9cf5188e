"""A flood of the same warning costs a line per second, and the last line says how many."""

from __future__ import annotations

import logging

from pagedserve.protocol.rate_limited_log import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ten_thousand_warnings_within_a_second_are_two_lines_with_the_total(caplog):
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("flood"), interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="flood"):
        for i in range(10_000):
            limited.warning("rejected frame on ipc://x", "bad frame %d", i)
        limited.flush()  # within the interval: nothing yet
        assert len(caplog.records) == 1 and "(1 total): bad frame 0" in caplog.text
        clock.now += 1.0
        limited.flush()
    assert len(caplog.records) == 2
    assert "(10000 total; 9999 more in the last 1s): last: bad frame 9999" in caplog.records[1].getMessage()
    assert limited.total("rejected frame on ipc://x") == 10_000


def test_kinds_are_limited_separately(caplog):
    limited = RateLimitedLog(logging.getLogger("kinds"), clock=Clock())
    with caplog.at_level(logging.WARNING, logger="kinds"):
        limited.warning("a", "x")
        limited.warning("b", "y")
        limited.warning("a", "z")
    assert [r.getMessage() for r in caplog.records] == ["a (1 total): x", "b (1 total): y"]
