"""Sampling: greedy at temperature 0, seeded streams independent of batch and preemption."""

from __future__ import annotations

import pytest
import torch

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.sampler import noise_seed, sample
from support.worker_harness import GREEDY, TrivialScheduler, random_prompts


def request(sampling: SamplingParams, num_outputs: int = 0) -> HeldRequest:
    return HeldRequest("r", [1] * (4 + num_outputs), 4, [0], 0, 1, sampling, sampling.seed or 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model_dir(tmp_path_factory.mktemp("m"), "qwen2"))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([8, 13, 5], vocab_size=512, seed=3)


def generate(model_dir, requests: list[tuple[str, list[int], SamplingParams, int]],
             preempt: str | None = None) -> dict[str, list[int]]:
    scheduler = TrivialScheduler(ModelRunner(model_dir))
    for req_id, prompt, sampling, arrival in requests:
        scheduler.add(req_id, prompt, 10, sampling, arrival_step=arrival)
    if preempt:
        scheduler.preempt(preempt, "recompute", at_step=4, resume_step=6)
    return scheduler.run()


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=kw.pop("temperature", 1.0), seed=seed, **kw)


def test_a_seeded_stream_is_the_same_whatever_shares_its_batch_and_after_preemption(model_dir, prompts):
    alone = generate(model_dir, [("x", prompts[0], seeded(7), 0)])["x"]
    crowded = generate(model_dir, [("a", prompts[1], seeded(1), 0), ("x", prompts[0], seeded(7), 2),
                                   ("b", prompts[2], GREEDY, 3)], preempt="x")["x"]
    assert alone == crowded


def test_different_seeds_give_different_streams(model_dir, prompts):
    streams = generate(model_dir, [(f"s{seed}", prompts[0], seeded(seed), 0) for seed in range(4)])
    assert len({tuple(s) for s in streams.values()}) == 4


@pytest.mark.parametrize("restriction", [dict(top_k=1), dict(top_p=1e-6)])
def test_a_one_token_restriction_samples_the_greedy_token(model_dir, prompts, restriction):
    greedy = generate(model_dir, [("g", prompts[1], GREEDY, 0)])["g"]
    restricted = generate(model_dir, [("g", prompts[1], seeded(5, temperature=1.5, **restriction), 0)])["g"]
    assert restricted == greedy


def test_greedy_ties_resolve_like_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample(logits, [request(GREEDY)]).token_ids == [1]


def test_top_k_and_top_p_only_sample_inside_their_sets():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.2, 0.05]]))
    top_k = [sample(logits, [request(seeded(s, top_k=2))]).token_ids[0] for s in range(200)]
    top_p = [sample(logits, [request(seeded(s, top_p=0.75))]).token_ids[0] for s in range(200)]
    assert set(top_k) == {1, 2}
    assert set(top_p) == {1, 2, 3}  # 0.4 + 0.3 < 0.75, so the 0.2 token is still needed


def test_sampling_follows_the_tempered_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    tokens = torch.tensor([sample(torch.log(probs)[None], [request(seeded(s))]).token_ids[0] for s in range(3000)])
    frequencies = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(frequencies, probs, atol=0.04)


def test_logprobs_are_of_the_sampled_token_under_the_unmodified_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.3, 0.2, 0.1]])
    requests = [request(seeded(3, temperature=0.5, top_k=2, logprobs=True)), request(GREEDY)]
    out = sample(logits, requests)
    expected = torch.log_softmax(logits, -1)[torch.arange(2), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), expected)
    assert sample(logits, [request(GREEDY), request(GREEDY)]).logprobs is None


def test_the_noise_seed_depends_on_both_the_seed_and_the_output_index():
    seeds = {noise_seed(seed, k) for seed in range(50) for k in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_at_a_temperature_follows_softmax_of_the_logits_divided_by_it(temperature):
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    num_draws = 4000  # fixed seeds 0..3999: the frequencies are the same on every run
    tokens = sample(logits.expand(num_draws, 3), [request(seeded(s, temperature=temperature))
                                                   for s in range(num_draws)]).token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=3).double() / num_draws
    tempered = torch.softmax(logits.double() / temperature, -1)
    untempered = torch.softmax(logits.double(), -1)
    total_variation = (frequencies - tempered).abs().sum() / 2
    # 0.03 is ~4 standard errors at 4000 draws; the untempered distribution is >= 0.12 away
    assert total_variation < 0.03
    assert (tempered - untempered).abs().sum() / 2 > 0.12
