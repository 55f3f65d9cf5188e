"""The step-timeout policy (scheduler_proc/step_timeout.py): a hung worker is caught in
seconds once steps are known, while warm-up and big steps get room."""

from __future__ import annotations

import pytest

from pagedserve.scheduler_proc.step_timeout import StepTimeout


def warmed(policy: StepTimeout, seconds: float = 0.02, tokens: int = 32, steps: int = 200) -> StepTimeout:
    for _ in range(steps):
        policy.observe(seconds, tokens)
    return policy


def test_before_enough_steps_the_operator_upper_bound_applies():
    policy = StepTimeout(upper_s=60)
    assert policy.for_step(32) == 60
    warmed(policy, steps=policy.warmup_steps - 1)
    assert policy.for_step(32) == 60
    policy.observe(0.02, 32)
    assert policy.for_step(32) == policy.floor_s


def test_fast_steady_steps_give_the_floor_so_a_stopped_worker_is_caught_within_seconds():
    policy = warmed(StepTimeout(upper_s=60))
    assert policy.for_step(32) == 5.0
    assert policy.for_step(1) == 5.0


def test_the_allowance_follows_slow_steps_but_never_exceeds_the_upper_bound():
    policy = warmed(StepTimeout(upper_s=60), seconds=1.5)
    assert policy.for_step(32) == pytest.approx(15.0)
    assert warmed(StepTimeout(upper_s=8), seconds=1.5).for_step(32) == 8
    assert warmed(StepTimeout(upper_s=3), seconds=0.001).for_step(32) == 3  # upper below the floor wins


def test_a_long_prefill_after_many_small_decodes_gets_time_in_proportion_to_its_tokens():
    policy = warmed(StepTimeout(upper_s=120), seconds=0.05, tokens=16)  # ~3 ms per token
    assert policy.for_step(32) == policy.floor_s  # within 2x of the sizes seen: 10 x 0.1 s, so the floor
    # 2000 tokens: far beyond anything seen lately, so the upper bound, not a guess
    assert policy.for_step(2000) == 120
    for _ in range(40):
        policy.observe(2.0, 1024)  # now big steps are known: the allowance follows them
    assert policy.for_step(2000) == pytest.approx(10 * 2.0 / 1024 * 2000)
    assert policy.for_step(16) == policy.floor_s  # and the small steps keep their own


def test_slow_single_token_steps_do_not_inflate_the_allowance_of_a_batch_of_decodes():
    """The CI failure: warm-up decodes of one token at 50 ms each made the cost per token
    50 ms, so a 32-decode step (80 ms) got 10 x 32 x 50 ms = 16 s instead of the floor."""
    policy = warmed(StepTimeout(upper_s=60), seconds=0.05, tokens=1, steps=64)
    warmed(policy, seconds=0.08, tokens=32, steps=16)
    assert policy.for_step(32) == policy.floor_s
    assert policy.for_step(40) == policy.floor_s  # same bucket


def test_a_size_seen_rarely_borrows_the_tighter_bound_of_its_neighbours():
    policy = warmed(StepTimeout(upper_s=60), seconds=0.01, tokens=1, steps=64)
    warmed(policy, seconds=3.0, tokens=512, steps=16)
    # 100 tokens, never seen: 512-token steps bound it by 3 s, single-token ones by 100 x 10 ms = 1 s
    assert policy.for_step(100) == pytest.approx(10 * 1.0)
    warmed(policy, seconds=0.1, tokens=1, steps=256)  # single tokens now cost 100 ms: the 512s bound it
    assert policy.for_step(100) == pytest.approx(10 * 3.0)


def test_one_slow_step_in_a_hundred_does_not_shrink_the_allowance_below_it():
    policy = StepTimeout(upper_s=60)
    for i in range(512):
        policy.observe(2.0 if i % 100 == 0 else 0.01, 32)
    assert policy.for_step(32) >= 10 * 2.0 * 0.99


def test_new_workers_warm_up_again():
    policy = warmed(StepTimeout(upper_s=60))
    policy.restart()
    assert policy.for_step(32) == 60


def test_a_few_big_prefills_do_not_inflate_the_allowance_of_the_small_decodes_after_them():
    policy = StepTimeout(upper_s=60)
    for _ in range(4):
        policy.observe(1.1, 200)  # 32 prompts prefilled
    warmed(policy, seconds=0.25, tokens=32, steps=60)
    assert policy.for_step(32) == policy.floor_s  # not 10 x 1.1 s
    assert policy.for_step(200) == pytest.approx(10 * 0.25 / 32 * 200)


def test_nonsense_settings_are_refused():
    with pytest.raises(ValueError):
        StepTimeout(upper_s=0)
    with pytest.raises(ValueError):
        StepTimeout(upper_s=10, factor=0.5)
