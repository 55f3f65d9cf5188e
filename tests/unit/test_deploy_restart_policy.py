"""Bounded restarts: immediate first, then doubling backoff, and a unit that crashes too often fails;
the schedule of units waiting out their backoff (the supervisor's replicas, the offline LLM's workers)."""

from __future__ import annotations

import pytest

from pagedserve.deploy.restart_policy import MAX_BACKOFF_S, RestartBudget, RestartSchedule


def test_restarts_back_off_doubling_up_to_the_cap_then_the_budget_is_spent():
    budget = RestartBudget(max_restarts=7, window_s=600.0)
    delays = [budget.next_delay("replica-0", now=100.0 + i) for i in range(8)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, MAX_BACKOFF_S, None]
    assert MAX_BACKOFF_S == 10.0


def test_each_unit_has_its_own_budget():
    budget = RestartBudget(max_restarts=1, window_s=60.0)
    assert budget.next_delay("replica-0", now=0.0) == 0.0
    assert budget.next_delay("replica-0", now=1.0) is None
    assert budget.next_delay("frontend", now=1.0) == 0.0


def test_restarts_older_than_the_window_no_longer_count():
    budget = RestartBudget(max_restarts=2, window_s=60.0)
    assert [budget.next_delay("r", now=t) for t in (0.0, 10.0, 20.0)] == [0.0, 0.5, None]
    assert budget.restarts_in_window("r", now=65.0) == 1  # the restart at 0 s left the window
    assert budget.next_delay("r", now=65.0) == 0.5
    assert budget.next_delay("r", now=200.0) == 0.0  # a quiet window: immediate again


def test_a_budget_of_no_restarts_fails_at_the_first_crash_and_bad_settings_are_refused():
    assert RestartBudget(max_restarts=0, window_s=1.0).next_delay("r", now=0.0) is None
    with pytest.raises(ValueError, match="window"):
        RestartBudget(max_restarts=1, window_s=0)


def test_restarts_are_at_once_then_backed_off_and_refused_once_the_budget_is_spent():
    schedule = RestartSchedule(RestartBudget(max_restarts=2, window_s=60.0))
    assert schedule.schedule(0, now=1.0) == 0.0 and 0 in schedule
    assert schedule.take_due(1.0) == [0] and 0 not in schedule
    assert schedule.schedule(0, now=2.0) == 0.5
    assert schedule.take_due(2.4) == [] and schedule.take_due(2.5) == [0]
    assert schedule.schedule(0, now=3.0) is None  # a third death within the window: give up
    assert schedule.schedule(1, now=3.0) == 0.0  # each replica has its own budget
    assert schedule.num_restarts == 3
    assert schedule.schedule(0, now=61.5) == 0.5  # the first death has left the window, not the second
