"""Async scheduling end to end: the offline LLM with the next step scheduled ahead (the
default) and with ``--no-async-scheduling`` gives transformers' greedy tokens, on a cache
tight enough to swap and recompute, with n > 1, prefix hits and stop tokens. Also with the
worker preparing the step sent ahead while the one before samples (``PAGEDSERVE_PREPARE_AHEAD=1``:
on CUDA by default; forced here so the CPU suite runs that path through real processes).
"""

from __future__ import annotations

import pytest

from support.oracle import hf_greedy
from pagedserve.offline.llm import LLM, SamplingParams

pytestmark = pytest.mark.slow

SHARED = [(11 * i + 5) % 400 + 3 for i in range(24)]  # three full blocks of 8
PROMPTS = [SHARED + [7, 8, 9], SHARED + [40, 41], [5, 6, 7, 8, 9, 10, 11], list(range(50, 90)),
           [300, 301, 302], SHARED + [99]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen2")


@pytest.fixture(scope="module")
def expected(model):
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def run(model: str, async_scheduling: bool, expected: list[list[int]], log_level: str = "WARNING"):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # The stop token of the third prompt is its 6th greedy token: the stream ends with it.
    stop = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                          stop_token_ids=[expected[2][5]])
    pair = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    params = [greedy, pair, stop, greedy, greedy, greedy]
    # 20 blocks of 8 tokens for ~7 sequences of up to 64 tokens: preemption by swap and recompute.
    with LLM(model, num_gpu_blocks=20, block_size=8, swap_space=0.00002, max_num_seqs=8,
             max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=True,
             async_scheduling=async_scheduling, debug_invariants=True, num_threads=1, log_level=log_level) as llm:
        llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # fills the prefix cache with SHARED
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.refresh_stats()[0]
    return outs, stats


@pytest.mark.parametrize("async_scheduling,prepare_ahead", [(True, ""), (True, "1"), (False, "")],
                         ids=["async", "async-prepared-ahead", "no-async"])
def test_greedy_tokens_equal_transformers_with_and_without_async_scheduling(model, expected, async_scheduling,
                                                                            prepare_ahead, monkeypatch, capfd):
    monkeypatch.setenv("PAGEDSERVE_PREPARE_AHEAD", prepare_ahead)
    outs, stats = run(model, async_scheduling, expected, log_level="INFO")
    said = "steps are prepared ahead" in capfd.readouterr().err
    assert said == (prepare_ahead == "1")
    for i, out in enumerate(outs):
        for sample in out.outputs:
            if i == 2:
                first_stop = expected[2].index(expected[2][5])
                assert sample.token_ids == expected[2][:first_stop + 1] and sample.finish_reason == "stop"
            else:
                assert sample.token_ids == expected[i] and sample.finish_reason == "length"
    assert len(outs[1].outputs) == 2
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hits > 0
    # every streamed token was counted once, and nothing past an end was
    streamed = sum(len(s.token_ids) for o in outs for s in o.outputs) + MAX_TOKENS  # + the warm-up
    assert stats.generation_tokens == streamed
