"""worker_proc/sampler.py's rules, checked exactly rather than statistically: which tokens top-k
and top-p leave (per row of a mixed batch), that every penalty value is applied, and the
seeded noise streams' pinned definition."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.sampler import GREEDY_TEMPERATURE, _apply_top_k_top_p, noise_seed, sample

PROBS = [0.05, 0.5, 0.1, 0.2, 0.15]  # token 1 best, then 3, 4, 2, 0
LOGITS = [math.log(p) for p in PROBS]
PINNED = [3952864364094478165, 3342518250691133789, 4018714269715226349, 7800752063267898898]


def kept(top_k: list[int], top_p: list[float], row: list[float] = LOGITS) -> list[set[int]]:
    logits = torch.tensor([row] * len(top_k))
    masked = _apply_top_k_top_p(logits, top_k, top_p)
    rows = []
    for row_in, row_out in zip(logits, masked):
        finite = torch.isfinite(row_out)
        assert torch.equal(row_out[finite], row_in[finite]), "a kept logit was changed"
        assert bool((row_out[~finite] == float("-inf")).all())
        rows.append(set(finite.nonzero().flatten().tolist()))
    return rows


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (4, {1, 3, 4, 2}), (5, {0, 1, 2, 3, 4}),
                                         (0, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_most_likely_tokens(k, expected):
    assert kept([k], [1.0]) == [expected]


@pytest.mark.parametrize("p, expected", [(0.01, {1}), (0.45, {1}), (0.6, {1, 3}), (0.75, {1, 3, 4}),
                                         (0.9, {1, 3, 4, 2}), (0.99, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_most_likely_tokens_until_their_mass_reaches_p(p, expected):
    # a token is kept while the mass of the tokens before it is at most p; the best always is
    assert kept([0], [p]) == [expected]


def test_top_p_applies_to_the_distribution_left_after_top_k():
    # top 2 renormalized: 0.5/0.7 ~ 0.714 before token 3, which 0.6 then cuts (0.2 of the
    # original mass would have kept it)
    assert kept([2], [0.6]) == [{1}]
    assert kept([3], [0.9]) == [{1, 3, 4}]


def test_ties_are_ranked_by_token_id():
    # 64 equal logits: probabilities and their running sums are exact (multiples of 1/64), so
    # top-p 0.5 keeps the tokens whose mass before them is at most 0.5 (33 of them), and which
    # of the tied tokens survive top-k or top-p is the lowest ids, whatever the sort's internals
    tied = [0.0] * 64
    assert kept([5, 0], [1.0, 0.5], tied) == [set(range(5)), set(range(33))]


def test_top_p_of_1_keeps_every_token_even_where_the_running_mass_rounds_above_1():
    # softmax of 0, -1, ..., -31 in float32: the running sum passes 1.0 before the last tokens
    # (on x86 CPUs), so a top-p filter that ran at p = 1 would cut them
    assert kept([0], [1.0], [-float(i) for i in range(32)]) == [set(range(32))]


def test_each_row_of_a_batch_has_its_own_top_k_and_top_p():
    assert kept([0, 2, 0, 1, 3], [1.0, 1.0, 0.6, 1.0, 0.75]) == [
        {0, 1, 2, 3, 4}, {1, 3}, {1, 3}, {1}, {1, 3}]


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=2.0), dict(frequency_penalty=1.0),
                                     dict(presence_penalty=1.0), dict(frequency_penalty=2.0, presence_penalty=0.5)])
def test_each_penalty_alone_moves_the_greedy_choice_off_a_repeated_token(penalty):
    # output so far: token 1 twice; token 1 leads token 3 by less than any of these penalties
    logits = torch.tensor([[0.0, 1.2, 0.0, 1.0, 0.0]])
    held = HeldRequest("r", [4, 4, 1, 1], 2, [0], 3, 1, SamplingParams(temperature=0.0, **penalty))
    assert sample(logits, [held]).token_ids == [3]
    plain = HeldRequest("r", [4, 4, 1, 1], 2, [0], 3, 1, SamplingParams(temperature=0.0))
    assert sample(logits, [plain]).token_ids == [1]


def test_the_noise_stream_of_a_seed_is_pinned():
    # Every seeded sample and every recorded trace depends on these values: changing the mix
    # changes what a seed means (bump the protocol version and re-record the goldens).
    assert [noise_seed(0, 0), noise_seed(1, 0), noise_seed(0, 1), noise_seed(2**63 + 5, 7)] == PINNED


def test_no_requests_sample_nothing():
    out = sample(torch.zeros(0, 5), [])
    assert out.token_ids == [] and out.logprobs is None and out.top_logprobs is None


def test_bias_and_penalties_leave_the_callers_logits_and_the_logprobs_raw():
    logits = torch.tensor([LOGITS])
    before = logits.clone()
    sampling = SamplingParams(temperature=0.0, logit_bias={0: 50.0}, repetition_penalty=2.0, logprobs=True)
    out = sample(logits, [HeldRequest("r", [1, 1], 1, [0], 2, 1, sampling)])
    assert out.token_ids == [0]  # the bias decided
    assert torch.equal(logits, before)
    assert out.logprobs == pytest.approx([math.log(PROBS[0])], abs=1e-5)  # of the unbiased distribution


def test_a_temperature_at_the_greedy_threshold_is_greedy():
    # tokens 0 and 1 differ by 1e-6: at T = 1e-5 a sample would pick token 1 ~45% of the time
    logits = torch.tensor([[1.0, 1.0 - 1e-6, -5.0]])
    held = [HeldRequest("r", [2], 1, [0], 0, 1, SamplingParams(temperature=GREEDY_TEMPERATURE), seed=s)
            for s in range(16)]
    assert {sample(logits, [h]).token_ids[0] for h in held} == {0}
