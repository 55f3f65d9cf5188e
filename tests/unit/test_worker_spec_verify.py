"""The worker's verification of speculative proposals (worker_proc/spec_verify.py), against
plainly written references: transformers' greedy tokens, the same engine without speculation,
and the textbook rejection-sampling rule, with a chi-square test and its p-value."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.sampler import sample
from pagedserve.worker_proc.spec_verify import accept, draft_rows

from pagedserve.tools.in_process_engine import generate
from support.oracle import hf_greedy

NGRAM = SpeculativeConfig("ngram", 4, 3, 1)
# repeated phrases, so prompt lookup has something to propose from the first decode on
PROMPTS = [[11, 12, 13, 14, 15] * 3, [5] * 6, [7, 8, 9, 10, 11, 12, 13, 7, 8]]  # [5] * 6: its output repeats


@pytest.mark.parametrize("setting", [
    dict(),
    dict(enable_prefix_caching=True),
    dict(num_gpu_blocks=30, num_cpu_blocks=16, preemption_mode="swap", max_num_seqs=3),
    dict(num_gpu_blocks=30, preemption_mode="recompute", max_num_seqs=3),
])
def test_greedy_tokens_with_speculation_equal_transformers(model_factory, setting):
    model = model_factory("qwen2")
    prompts = PROMPTS * 2  # the second copy hits the prefix cache when it is on
    greedy = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(prompts)
    streams, sched = generate(model, prompts, greedy, NGRAM, **setting)
    for i, prompt in enumerate(prompts):
        assert streams[(f"r{i}", 0)] == hf_greedy(model, prompt, 40), i
    stats = sched.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["generation_tokens"] == 40 * len(prompts)


def test_seeded_samples_are_the_same_with_and_without_speculation(model_factory):
    """Each position draws with its own output index's noise, so a seeded request's tokens do not
    depend on speculation at all: penalties, top-k/top-p and n > 1 included."""
    model = model_factory("qwen2")
    params = [SamplingParams(**{"max_tokens": 32, "temperature": 0.3, "seed": s, "ignore_eos": True, **extra})
              for s, extra in enumerate([{"temperature": 0.05}, {"repetition_penalty": 1.3, "top_k": 20},
                                         {"top_p": 0.9, "n": 2}, {"frequency_penalty": 0.5, "presence_penalty": 0.2}])]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]]  # the first one's output repeats
    plain, _ = generate(model, prompts, params)
    spec, sched = generate(model, prompts, params, NGRAM)
    assert spec == plain
    assert sched.stats()["spec_decode_num_accepted_tokens"] > 0


def _chi_square_p(observed: list[int], expected: list[float], ddof: int = 0) -> float:
    """Pearson's test: the p-value of ``observed`` counts under ``expected`` counts."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = sum(e > 0 for e in expected) - 1 - ddof
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _reference_rejection(p: list[float], p_next: list[float], draft: int, rng: random.Random) -> tuple:
    """The textbook rule for a point-mass proposal q = [draft]: accept with probability
    min(1, p(draft) / q(draft)) = p(draft), then draw the next token from p_next; on rejection
    draw from max(0, p - q), normalised."""
    if rng.random() < p[draft]:
        return draft, rng.choices(range(len(p_next)), p_next)[0]
    residual = [0.0 if t == draft else pt for t, pt in enumerate(p)]
    return rng.choices(range(len(p)), residual)[0], None


def test_rejection_sampling_keeps_the_target_distribution_and_matches_the_textbook_rule():
    vocab = 6
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.3, 1.5, 0.1, -0.2, 0.8, 0.0]])
    p, p_next = torch.softmax(logits, 1).tolist()
    draft = 0  # p(draft) ~ 0.19: most proposals are rejected, so both branches are well sampled
    n = 4000
    ours, firsts, seconds = Counter(), [0] * vocab, [0] * vocab
    for seed in range(n):
        req = HeldRequest("r", [1, 2], 2, [], 0, 1, SamplingParams(temperature=1.0, seed=seed, max_tokens=8))
        rows = draft_rows(req, [draft])
        sampled = sample(logits.clone(), rows)
        entries, tokens, _, accepted = accept(rows, sampled.token_ids, {"r": [draft]})
        emitted = [draft, tokens[0]] if accepted["r"] else [tokens[0]]
        ours[tuple(emitted)] += 1
        firsts[emitted[0]] += 1
        if len(emitted) == 2:
            seconds[emitted[1]] += 1
    # the first token is distributed as p, the one after an accepted proposal as p_next
    p_first = _chi_square_p(firsts, [n * pt for pt in p])
    p_second = _chi_square_p(seconds, [firsts[draft] * pt for pt in p_next])
    rng = random.Random(1)
    reference = Counter(_reference_rejection(p, p_next, draft, rng) for _ in range(n))
    reference = Counter({tuple(t for t in k if t is not None): v for k, v in reference.items()})
    outcomes = sorted(set(ours) | set(reference))
    # two samples of n each: homogeneity test on the pooled table
    pooled = [(ours[o] + reference[o]) / 2 for o in outcomes]
    p_same = _chi_square_p([ours[o] for o in outcomes] + [reference[o] for o in outcomes], pooled + pooled,
                           ddof=len(outcomes))  # df = outcomes - 1
    assert min(p_first, p_second, p_same) > 1e-3, (p_first, p_second, p_same)
    assert abs(firsts[draft] / n - p[draft]) < 0.03  # the acceptance rate is p(draft)


def test_greedy_acceptance_is_exact_match_and_the_block_table_drops_what_was_rejected():
    req = HeldRequest("r", [1, 2, 3], 3, [7, 8, 9], 2, 1, SamplingParams(temperature=0.0, max_tokens=8))
    rows = draft_rows(req, [5, 4, 3])
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([5, 4, 6, 1]):  # proposals 5 and 4 right, 3 wrong (6 sampled instead)
        logits[row, token] = 5.0
    sampled = sample(logits, rows)
    entries, tokens, kept_rows, accepted = accept(rows, sampled.token_ids, {"r": [5, 4, 3]})
    assert (entries, tokens, kept_rows, accepted) == ([req], [6], [2], {"r": 2})
    from pagedserve.protocol.step_state import note_accepted

    note_accepted({"r": req}, accepted, block_size=2)  # computed 2 + 1 + 2 accepted = 5 positions
    assert req.num_computed_tokens + req.num_scheduled_tokens == 5 and req.block_ids == [7, 8, 9]
    note_accepted({"r": req}, {"r": 0}, block_size=4)
    assert req.block_ids == [7, 8]
