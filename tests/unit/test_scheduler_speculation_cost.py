"""Speculation backs off by expected gain: a verification position's cost is measured from the
steps' recorded clock, and a sequence proposes only what its acceptance makes worth that cost
(scheduler_proc/spec_cost.py). The clocks here are scripted, so every decision is the same on
any machine, as it is in a replay of the recorded clock."""

from __future__ import annotations

import pytest

from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.scheduler_proc.spec_cost import MIN_SAMPLES, PRIOR_RHO, StepCost, worth_proposing

from support.scheduler_sim import SimWorker, StepDriver, counting_tokens, request

K = 4


def test_rho_is_a_rows_extra_time_over_one_sequences_plain_decode_and_idle_gaps_are_not_costs():
    cost = StepCost()
    assert cost.rho == PRIOR_RHO
    now, step = 0.0, 0
    for _ in range(2 * MIN_SAMPLES):
        step += 1
        cost.observe(step, now, 2, 0, True, overlapped=True)  # two sequences, 10 ms a step: 5 ms a sequence
        now += 0.010
    for _ in range(2 * MIN_SAMPLES):
        step += 1
        cost.observe(step, now, 2, 4, True, overlapped=False)  # plus 4 rows for 2 ms more: 0.5 ms a row
        now += 0.012
    cost.observe(step + 1, now, 2, 0, True, overlapped=True)
    assert cost.rho == pytest.approx(0.1)
    cost.observe(step + 2, now + 60.0, 2, 0, True, overlapped=True)  # a minute with no requests
    assert cost.rho == pytest.approx(0.1)


def test_a_plain_step_a_speculating_sequence_held_back_counts_as_if_it_had_overlapped():
    # 6 ms of forward and 4 of host work: 10 ms in a row, 6 overlapped in the decode lane
    cost = StepCost()
    now = 0.0
    for step in range(1, 2 * MIN_SAMPLES + 1):
        cost.observe(step, now, 1, 0, True, overlapped=False)
        cost.note_forward(step, 0.006)
        now += 0.010
    cost.observe(2 * MIN_SAMPLES + 1, now, 1, 0, True, overlapped=False)
    assert cost.per_seq == pytest.approx(0.006)


def test_proposals_are_the_ones_whose_expected_tokens_outweigh_their_rows():
    assert worth_proposing(0, 0, PRIOR_RHO, K) == K  # a fresh sequence at the prior explores with all k
    assert worth_proposing(0, 0, 0.6, K) == 0  # even odds never pay a row costing 0.6 of a decode
    assert worth_proposing(7, 1, 0.3, K) == 4  # alpha 0.8: 0.8^4 = 0.41 > 0.3
    assert worth_proposing(1, 3, 0.3, K) == 1  # alpha 1/3: only the first position pays
    assert worth_proposing(0, 4, 0.1, K) == 1  # alpha 1/6 still beats a row at 0.1
    assert worth_proposing(0, 6, 0.2, K) == 0


class PricedClock:
    """A step's cycle: ``per_seq`` per sequence plus ``per_row`` per proposed position."""

    def __init__(self, per_seq: float, per_row: float):
        self.per_seq, self.per_row, self.now = per_seq, per_row, 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, out) -> None:
        seqs = len(out.new_requests) + len(out.cached_requests) + len(out.decodes.req_ids)
        self.now += self.per_seq * seqs + self.per_row * sum(len(d) for d in out.spec_token_ids.values())


class EveryOtherRight:
    """Proposes the counting tokens that come next, the first one right every other call."""

    def __init__(self):
        self.calls = 0

    def propose(self, tokens, max_tokens: int) -> list[int]:
        self.calls += 1
        right = 1 if self.calls % 2 else 0
        return [1000 + len(tokens) + j + (j >= right) for j in range(max_tokens)]


def run(per_row: float, proposer, num_requests: int = 1, max_tokens: int = 120):
    clock = PricedClock(0.010, per_row)
    config = SchedulerConfig(block_size=4, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                             max_model_len=256, debug_invariants=True, speculative=SpeculativeConfig("ngram", K, 4, 1))
    sched = Scheduler(config, clock=clock, proposer=proposer)
    for i in range(num_requests):
        sched.add_request(request(f"r{i}", [5, 6, 7], max_tokens=max_tokens, ignore_eos=True))
    driver = StepDriver(sched, SimWorker(config, counting_tokens()), ahead=True)
    driver.on_schedule = clock.charge
    proposed_at = []
    while driver.busy():
        out, _, _ = driver.step()
        if out.spec_token_ids:
            proposed_at.append(out.step)
    return sched, driver, proposed_at


def test_where_a_row_costs_more_than_acceptance_earns_a_sequence_stops_within_a_few_steps_and_overlaps_again():
    sched, driver, proposed_at = run(per_row=0.006, proposer=EveryOtherRight())  # rho 0.6, alpha about 1/3
    assert 0 < len(proposed_at) <= 2 * MIN_SAMPLES + 2
    assert driver.steps_ahead > 100  # the rest in the decode lane, overlapped
    # the cost is now known: a request arriving later never speculates at all
    sched.add_request(request("late", [5, 6, 7], max_tokens=40, ignore_eos=True))
    while driver.busy():
        out, _, _ = driver.step()
        assert not out.spec_token_ids


def test_where_rows_are_cheap_the_same_acceptance_keeps_proposing():
    _, _, proposed_at = run(per_row=0.0002, proposer=EveryOtherRight())  # rho 0.02
    assert len(proposed_at) > 40


def test_the_same_recorded_clock_gives_the_same_proposals():
    first = run(per_row=0.004, proposer=EveryOtherRight(), num_requests=3)[2]
    assert first == run(per_row=0.004, proposer=EveryOtherRight(), num_requests=3)[2]


def test_the_backoff_is_named_in_the_flag_and_anything_else_is_refused_in_one_line():
    from pagedserve.protocol.speculative import SpeculativeConfigError, parse_speculative_config

    base = {"method": "ngram", "num_speculative_tokens": 4}
    assert parse_speculative_config(base).backoff == "expected_gain"
    acceptance = parse_speculative_config({**base, "backoff": "acceptance"})
    assert acceptance.backoff == "acceptance" and '"backoff": "acceptance"' in acceptance.to_json()
    with pytest.raises(SpeculativeConfigError, match="backoff must be one of expected_gain, acceptance"):
        parse_speculative_config({**base, "backoff": "never"})


def test_under_the_acceptance_backoff_a_dear_row_does_not_stop_a_sequence_that_is_right():
    clock = PricedClock(0.010, 0.050)  # a row costs five plain decodes
    config = SchedulerConfig(block_size=4, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                             max_model_len=256, speculative=SpeculativeConfig("ngram", K, 4, 1, "acceptance"))

    class Right:
        def propose(self, tokens, max_tokens):
            return [1000 + len(tokens) + j for j in range(max_tokens)]

    sched = Scheduler(config, clock=clock, proposer=Right())
    sched.add_request(request("r", [5, 6, 7], max_tokens=100, ignore_eos=True))
    driver = StepDriver(sched, SimWorker(config, counting_tokens()))
    driver.on_schedule = clock.charge
    steps = 0
    while driver.busy():
        driver.step()
        steps += 1
    assert steps < 100 // 3 and sched.stats()["spec_decode_num_accepted_tokens"] > 70
