"""Every causal LM in transformers' mapping, built tiny and random, through the transformers backend:
at least WALK_FLOOR of them give transformers' greedy tokens, and every other one is refused in one
line or fails for a reason the report names (support/causal_lm_walk.py; run it as a script for the list).
The walk runs in PARTS pieces, each well within the per-test timeout on 2 busy cores."""

from __future__ import annotations

import functools

import pytest

from support.causal_lm_walk import report, walk

# 100 of 188 served at parity with transformers 5.25.0 (about 40 s on 2 cores); the margin is for a
# transformers release that adds or reshapes an architecture, not for regressions of the backend.
WALK_FLOOR = 95
PARTS = 4


@functools.cache
def _outcomes(part: int) -> tuple:
    return tuple(walk(new_tokens=4, part=part, parts=PARTS))


@pytest.mark.parametrize("part", range(PARTS))
def test_each_architecture_of_a_part_of_the_walk_serves_at_parity_or_is_refused_in_one_line(part):
    for o in _outcomes(part):
        assert o.ok or "\n" not in o.reason, o.reason


def test_at_least_the_floor_of_causal_lms_transformers_maps_serve_at_parity_through_the_backend(capsys):
    outcomes = [o for part in range(PARTS) for o in _outcomes(part)]  # the parts' runs, reused
    summary = report(outcomes)
    with capsys.disabled():
        print("\n" + summary)
    assert sum(o.ok for o in outcomes) >= WALK_FLOOR, summary
