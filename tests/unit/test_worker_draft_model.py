"""Speculative decoding with a draft model (worker_proc/draft_model.py), a real scheduler driving
a real worker in one process, against transformers' greedy tokens and the engine without
speculation: the draft's cache follows the target's through prefix caching, swaps and
recomputes, and whatever the draft proposes, the tokens are the target's."""

from __future__ import annotations

import pytest

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_runner import ModelRunner

from pagedserve.tools.in_process_engine import generate
from support.oracle import hf_greedy

PROMPTS = [[11, 12, 13, 14, 15] * 3, [5] * 6, [7, 8, 9, 10, 11, 12, 13, 7, 8]]
MAX_TOKENS = 32


def draft_config(model: str) -> SpeculativeConfig:
    # by acceptance alone: a proposal's measured cost must not switch a test's drafts off
    return SpeculativeConfig("draft_model", 4, 0, 0, "acceptance", model)


@pytest.fixture
def small_draft(model_factory) -> str:
    """A random 1-layer model with the target's vocabulary and tokenizer, and other weights."""
    return model_factory("qwen2", num_layers=1, hidden_size=32, intermediate_size=64, seed=7)


def test_the_target_as_its_own_draft_is_always_right_and_gives_transformers_tokens(model_factory):
    model = model_factory("qwen2")
    greedy = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    streams, sched = generate(model, PROMPTS, greedy, draft_config(model))
    for i, prompt in enumerate(PROMPTS):
        assert streams[(f"r{i}", 0)] == hf_greedy(model, prompt, MAX_TOKENS), i
    stats = sched.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_drafts"] >= len(PROMPTS) * (MAX_TOKENS // 5 - 1)  # every step after the first


@pytest.mark.parametrize("setting", [
    dict(),
    dict(enable_prefix_caching=True),
    dict(num_gpu_blocks=30, num_cpu_blocks=16, preemption_mode="swap", max_num_seqs=3),
    dict(num_gpu_blocks=30, preemption_mode="recompute", max_num_seqs=3),
])
def test_greedy_tokens_with_a_smaller_draft_equal_transformers(model_factory, small_draft, setting):
    model = model_factory("qwen2")
    prompts = PROMPTS * 2  # the second copy hits the prefix cache when it is on
    greedy = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(prompts)
    streams, sched = generate(model, prompts, greedy, draft_config(small_draft), **setting)
    for i, prompt in enumerate(prompts):
        assert streams[(f"r{i}", 0)] == hf_greedy(model, prompt, MAX_TOKENS), i
    stats = sched.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["generation_tokens"] == MAX_TOKENS * len(prompts)
    if "preemption_mode" in setting:
        assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0


def test_seeded_samples_are_the_same_with_and_without_a_draft(model_factory):
    """Each position draws with its own output index's noise and the draft proposes a point mass,
    so a seeded request's tokens do not depend on the draft: its distribution is the target's."""
    model = model_factory("qwen2")
    params = [SamplingParams(max_tokens=24, temperature=t, seed=s, ignore_eos=True, **extra)
              for s, (t, extra) in enumerate([(0.05, {}), (0.8, {"top_k": 20}), (1.0, {"n": 2})])]
    plain, _ = generate(model, PROMPTS, params)
    spec, sched = generate(model, PROMPTS, params, draft_config(model))
    assert spec == plain
    assert sched.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(model_factory):
    model = model_factory("qwen2")
    other = model_factory("qwen2", vocab_size=640, num_layers=1)
    with pytest.raises(ValueError, match="vocabulary of 640") as refused:
        ModelRunner(model, speculative=draft_config(other))
    assert "\n" not in str(refused.value)
    with pytest.raises((ValueError, UnsupportedModelError), match="tensor-parallel-size"):
        ModelRunner(model, speculative=draft_config(model), tp_size=2)
