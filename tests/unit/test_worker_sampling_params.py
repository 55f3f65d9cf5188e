"""The sampling controls against transformers' logits processors on the same logits.

Penalties, min_p and logit_bias are checked on batches whose rows carry different parameters
(so a row's control never leaks into its neighbour), greedy and seeded; top-k logprobs are
checked against log_softmax of the raw logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.step_state import HeldRequest as RequestState
from pagedserve.worker_proc.logits_processors import apply_min_p
from pagedserve.worker_proc.sampler import sample

VOCAB = 64


def state(prompt: list[int], outputs: list[int], **params) -> RequestState:
    sampling = SamplingParams(temperature=params.pop("temperature", 0.0), **params)
    return RequestState("r", prompt + outputs, len(prompt), [0], 0, 1, sampling, sampling.seed or 0)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def histories(logits: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """Per row, a prompt and outputs that include the row's best tokens, so penalties bite."""
    best = logits.topk(6, dim=-1).indices.tolist()
    return [([b[0], b[1], 5], [b[2], b[2], b[0]]) for b in best]


def test_greedy_with_repetition_penalty_is_transformers_argmax_per_row(logits):
    penalties = [1.0, 1.3, 2.0, 0.5]
    rows = histories(logits)
    requests = [state(p, o, repetition_penalty=pen) for (p, o), pen in zip(rows, penalties)]
    expected = []
    for row, ((prompt, outputs), pen) in enumerate(zip(rows, penalties)):
        processed = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([prompt + outputs]), logits[row:row + 1].clone())
        expected.append(int(processed.argmax()))
    assert sample(logits, requests).token_ids == expected
    assert expected != logits.argmax(-1).tolist()  # the penalty changed some choice


def test_presence_and_frequency_penalties_count_only_output_tokens(logits):
    rows = histories(logits)
    params = [(0.0, 0.0), (2.0, 0.0), (0.0, 1.5), (-0.5, 0.7)]
    requests = [state(p, o, presence_penalty=pr, frequency_penalty=fr) for (p, o), (pr, fr) in zip(rows, params)]
    expected = []
    for row, ((prompt, outputs), (presence, frequency)) in enumerate(zip(rows, params)):
        counts = torch.bincount(torch.tensor(outputs), minlength=VOCAB).float()
        expected.append(int((logits[row] - frequency * counts - presence * (counts > 0).float()).argmax()))
    assert sample(logits, requests).token_ids == expected
    assert expected != logits.argmax(-1).tolist()


def test_penalties_equal_transformers_processed_scores_when_combined_with_bias(logits):
    prompt, outputs = histories(logits)[0]
    bias = {3: 5.0, int(logits[0].argmax()): -4.0}
    req = state(prompt, outputs, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=bias)
    scores = logits[:1].clone()
    scores = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([prompt + outputs]), scores)
    scores = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + outputs]), scores)
    scores -= 0.5 * torch.bincount(torch.tensor(outputs), minlength=VOCAB).float()
    for seed in range(20):  # a low temperature sharpens any mismatch into a different token
        hot = state(prompt, outputs, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=bias,
                    temperature=0.7, seed=seed)
        reference = torch.softmax(scores / 0.7, -1)
        assert reference[0, sample(logits[:1], [hot]).token_ids[0]] > 0
    assert sample(logits[:1], [req]).token_ids == [int(scores.argmax())]


def test_logit_bias_forces_and_bans_tokens_per_row(logits):
    best = logits.argmax(-1).tolist()
    requests = [state([1], [], logit_bias={7: 100.0}), state([1], [], logit_bias={best[1]: -100.0}),
                state([1], []), state([1], [], logit_bias={9: 100.0}, temperature=1.0, seed=4)]
    second = int(logits[1].topk(2).indices[1])
    assert sample(logits, requests).token_ids == [7, second, best[2], 9]


def test_min_p_removes_what_transformers_min_p_removes(logits):
    min_ps = [0.0, 0.05, 0.3, 0.9]
    kept = torch.isfinite(apply_min_p(logits.clone(), min_ps))
    for row, min_p in enumerate(min_ps):
        reference = logits[row:row + 1] if min_p == 0 else MinPLogitsWarper(min_p)(None, logits[row:row + 1].clone())
        assert torch.equal(kept[row], torch.isfinite(reference[0]))


def test_sampling_with_min_p_stays_inside_the_min_p_set(logits):
    allowed = torch.isfinite(MinPLogitsWarper(0.2)(None, logits[2:3].clone()))[0]
    tokens = {sample(logits[2:3], [state([1], [], min_p=0.2, temperature=1.0, seed=s)]).token_ids[0] for s in range(200)}
    assert tokens <= set(allowed.nonzero().flatten().tolist()) and len(tokens) > 1


def test_a_penalized_seeded_sample_is_the_same_whatever_shares_its_batch(logits):
    rows = histories(logits)
    mine = state(*rows[1], presence_penalty=1.0, repetition_penalty=1.2, min_p=0.05, temperature=1.0, seed=11)
    others = [state(*rows[0], frequency_penalty=2.0, temperature=1.0, seed=3), state(*rows[2])]
    alone = sample(logits[1:2], [mine]).token_ids[0]
    crowded = sample(torch.stack([logits[0], logits[1], logits[2]]), [others[0], mine, others[1]]).token_ids[1]
    assert alone == crowded


def test_top_logprobs_are_log_softmax_of_the_raw_logits(logits):
    requests = [state([1], [], logprobs=True, top_logprobs=5), state([1], []),
                state([1], [], logprobs=True, top_logprobs=2, repetition_penalty=2.0, temperature=1.0, seed=1),
                state([1], [], logprobs=True)]
    out = sample(logits, requests)
    reference = torch.log_softmax(logits, -1)
    for row, k in enumerate([5, 0, 2, 0]):
        pairs = out.top_logprobs[row]
        values, ids = reference[row].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in pairs] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in pairs]), values, atol=1e-4)
    assert out.logprobs[0] == pytest.approx(reference[0, out.token_ids[0]].item(), abs=1e-4)
    assert sample(logits, [state([1], [], logprobs=True)]).top_logprobs is None


def test_min_tokens_holds_back_the_stop_tokens_as_transformers_min_new_tokens_does(logits):
    """vLLM's min_tokens: before that many outputs, no stop token (EOS, stop_token_ids) can be
    chosen, so the output neither holds one nor ends early; from then on they are ordinary."""
    best = logits.argmax(-1).tolist()
    cases = [([], 2), ([9], 2), ([9, 9], 2), ([], 0)]  # (outputs so far, min_tokens): before, before, at, none
    requests, expected = [], []
    for row, (outputs, min_tokens) in enumerate(cases):
        stops = [best[row], 5]
        req = state([1, 2], outputs, min_tokens=min_tokens)
        req.min_tokens_stops = tuple(stops) if min_tokens else ()  # as the scheduler sends them
        requests.append(req)
        reference = MinNewTokensLengthLogitsProcessor(2, min_tokens, stops)
        expected.append(int(reference(torch.tensor([[1, 2] + outputs]), logits[row:row + 1].clone()).argmax()))
    out = sample(logits, requests)
    assert out.token_ids == expected
    assert [e == b for e, b in zip(expected, best)] == [False, False, True, True]
    # sampled: never a held-back stop token, whatever the seed, though it is the likeliest
    held = [state([1, 2], [], min_tokens=3, temperature=1.0, seed=seed) for seed in range(200)]
    for req in held:
        req.min_tokens_stops = (best[0],)
    assert best[0] not in sample(logits[:1].repeat(200, 1), held).token_ids
    # a row whose only allowed token is a stop token (a grammar's end) keeps it: the grammar wins
    only_stop = torch.full((1, VOCAB), -torch.inf)
    only_stop[0, 5] = 0.0
    req = state([1, 2], [], min_tokens=2)
    req.min_tokens_stops = (5,)
    assert sample(only_stop, [req]).token_ids == [5]
