"""worker_proc/sampler.py's rules, checked exactly rather than statistically: which tokens top-k
and top-p leave (per row of a mixed batch), that every penalty value is applied, the seeded
noise streams' pinned definition, and the chunked race's draws."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.logits_processors import apply_penalties
from pagedserve.worker_proc.sampler import (CHUNK, GREEDY_TEMPERATURE, TOP_CANDIDATES, _apply_top_k_top_p,
                                           _from_candidates, exponential_noise, noise_seed, race_sample, sample)

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


_MASK64 = (1 << 64) - 1


def _splitmix64(state: int, j: int) -> int:
    """The generator's output j + 1 from ``state``, in Python's unbounded integers."""
    z = (state + (j + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def test_the_noise_of_a_key_is_splitmix64s_stream_in_any_batch():
    # int64 tensors stand for unsigned words: a sign-keeping shift or a lost wrap would differ here
    keys = [noise_seed(0, 0), noise_seed(1, 5), noise_seed(2**63 + 5, 7), 0, 2**63 - 1]
    noise = exponential_noise(torch.tensor(keys), 300)
    expected = torch.tensor([[-math.log1p(-(_splitmix64(k, j) >> 11) * 2.0**-53) for j in range(300)] for k in keys],
                            dtype=torch.float64)
    assert torch.allclose(noise, expected, rtol=1e-15, atol=0)  # log1p's last bit may differ from libm's
    assert torch.equal(exponential_noise(torch.tensor(keys[1:2]), 300), noise[1:2])
    assert bool((noise >= 0).all()) and 0.9 < float(noise.mean()) < 1.1


def _probs_with_zeros(vocab: int) -> torch.Tensor:
    """Mass spread over every chunk, with zeros at the start, in a whole chunk and at the end."""
    probs = torch.rand(vocab, generator=torch.Generator().manual_seed(vocab)) ** 4
    probs[:2] = 0
    probs[CHUNK: 2 * CHUNK] = 0
    probs[-3 if vocab > CHUNK else -1:] = 0
    return probs


@pytest.mark.parametrize("vocab", [5, 3 * CHUNK + 41])
def test_the_race_never_draws_a_token_of_probability_zero(vocab):
    probs = _probs_with_zeros(vocab)
    keys = torch.tensor([noise_seed(seed, 0) for seed in range(2000)])
    drawn = race_sample(probs.expand(len(keys), vocab), keys)
    assert bool((probs[drawn] > 0).all())
    assert {t // CHUNK for t in drawn.tolist()} == {t // CHUNK for t in (probs > 0).nonzero().flatten().tolist()}


def test_the_chunked_race_draws_each_token_with_its_probability():
    # mass in four chunks, the last one the vocabulary's partial tail; 8000 fixed keys
    vocab, tokens = 3 * CHUNK + 41, [5, CHUNK + 2, 2 * CHUNK + 100, 3 * CHUNK + 40]
    weights = torch.tensor([0.1, 0.3, 0.2, 0.4])
    probs = torch.zeros(vocab)
    probs[tokens] = weights * 7  # any total
    keys = torch.tensor([noise_seed(seed, 3) for seed in range(8000)])
    drawn = race_sample(probs.expand(len(keys), vocab), keys).tolist()
    frequencies = torch.tensor([drawn.count(t) for t in tokens], dtype=torch.float64) / len(drawn)
    assert sum(frequencies) == 1
    assert float((frequencies - weights).abs().sum()) / 2 < 0.02  # ~3 standard errors at 8000 draws


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


def _kept_plainly(row: list[float], k: int, p: float) -> set[int]:
    """The rule written out: rank by (logit desc, id), keep k, renormalize, keep while the mass
    before a token is at most p."""
    ranked = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k if k > 0 else len(row)]
    if p >= 1.0:
        return set(ranked)
    weights = [math.exp(row[t] - row[ranked[0]]) for t in ranked]
    total, before, kept = sum(weights), 0.0, set()
    for t, w in zip(ranked, weights):
        if before > p:
            break
        kept.add(t)
        before += w / total
    return kept


def _large_rows() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    rows = {"peaked": torch.randn(3000, generator=generator) * 4, "flat": torch.randn(3000, generator=generator) * 0.1}
    tied = torch.randn(3000, generator=generator)
    ranked = tied.argsort(descending=True)
    tied[ranked[TOP_CANDIDATES - 3: TOP_CANDIDATES + 2]] = tied[ranked[TOP_CANDIDATES - 1]].item()
    inside = rows["peaked"].clone()  # a tie across top-k's cut, well inside the candidates
    ranked = inside.argsort(descending=True)
    inside[ranked[8:13]] = inside[ranked[10]].item()
    return {**rows, "tied": tied, "tied inside": inside}


@pytest.mark.parametrize("batch, among_candidates", [
    # 3000 tokens, more than the CPU's candidates: rows that cut inside them, rows left alone beside them
    ([("peaked", 20, 0.8), ("peaked", 0, 0.9), ("peaked", 0, 1.0), ("peaked", 50, 1.0), ("flat", 5, 0.5),
      ("tied inside", 11, 1.0)], True),
    ([("peaked", 20, 0.8), ("flat", 0, 0.95)], False),  # its top-p needs more tokens than the candidates
    ([("tied", 0, 0.3)], False),  # a tie at the candidates' last place
    ([("peaked", 20, 0.9), ("peaked", 3, 1.0)], True),  # every row has a top-k: its best max(top-k) decide
    ([("tied inside", 11, 1.0)], False),  # ... and a tie across it
    ([("peaked", 2000, 0.9)], False),  # a top-k past them
])
def test_a_large_vocabulary_decides_top_k_and_top_p_as_the_rule_says_among_its_best_tokens_or_not(
        batch, among_candidates):
    source = _large_rows()
    rows = torch.stack([source[name] for name, _, _ in batch])
    top_k, top_p = [k for _, k, _ in batch], [p for _, _, p in batch]
    assert (_from_candidates(rows, top_k, top_p) is not None) == among_candidates
    masked = _apply_top_k_top_p(rows, top_k, top_p)
    for row in range(len(rows)):
        kept = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert kept == _kept_plainly(rows[row].tolist(), top_k[row], top_p[row]), batch[row]
        assert torch.equal(masked[row, sorted(kept)], rows[row, sorted(kept)])


def _penalized_densely(logits: torch.Tensor, requests: list[HeldRequest]) -> torch.Tensor:
    """The penalties over [rows, vocab] counts, the form they had before they went sparse."""
    out = logits.clone()
    for row, r in enumerate(requests):
        s = r.sampling
        outputs = torch.bincount(torch.tensor(r.token_ids[r.num_prompt_tokens:], dtype=torch.long),
                                 minlength=logits.shape[1]).to(logits.dtype)
        seen = torch.bincount(torch.tensor(r.token_ids, dtype=torch.long), minlength=logits.shape[1]) > 0
        penalty = torch.tensor(s.repetition_penalty, dtype=logits.dtype)
        sub = torch.where(seen, torch.where(out[row] > 0, out[row] / penalty, out[row] * penalty), out[row])
        frequency = torch.tensor(s.frequency_penalty, dtype=logits.dtype)
        presence = torch.tensor(s.presence_penalty, dtype=logits.dtype)
        out[row] = sub - frequency * outputs - presence * (outputs > 0).to(logits.dtype)
    return out


def test_penalties_touch_only_the_contexts_tokens_and_give_the_dense_forms_bits():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2000, generator=generator) * 3
    tokens = torch.randint(0, 2000, (5, 300), generator=generator).tolist()
    params = [dict(repetition_penalty=1.05), dict(), dict(frequency_penalty=0.5, presence_penalty=0.25),
              dict(repetition_penalty=1.3, frequency_penalty=-0.4, presence_penalty=1.0), dict(presence_penalty=2.0)]
    requests = [HeldRequest(f"r{i}", tokens[i], 200, [0], 3, 1, SamplingParams(temperature=1.0, **p))
                for i, p in enumerate(params)]
    expected = _penalized_densely(logits, requests)
    apply_penalties(logits, requests)
    assert torch.equal(logits, expected)
    placeholder = HeldRequest("p", [5, 6, -1], 2, [0], 3, 1, SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="placeholder"):
        apply_penalties(logits, [placeholder])
