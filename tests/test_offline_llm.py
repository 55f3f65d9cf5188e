"""The offline API: LLM.generate runs the real scheduler and worker processes, no frontend."""

from __future__ import annotations

import os

import psutil
import pytest

from conftest import hf_greedy, hf_tokenizer
from pagedserve.deploy.offline import LLM, SamplingParams

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "東京は"]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen2")


@pytest.mark.slow
def test_greedy_generate_equals_transformers_keeps_input_order_and_close_stops_every_process(model):
    tok = hf_tokenizer(model)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(model, num_gpu_blocks=64, max_model_len=512) as llm:
        pids, run_dir = llm.pids(), llm.run_dir
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        outs = llm.generate(PROMPTS + [[5, 6, 7, 8, 9]], greedy, use_tqdm=False)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 1, 4)]
        ordered = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]], params, use_tqdm=False)
        too_long = llm.generate([[3] * 600], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    for prompt, out in zip(PROMPTS + [[5, 6, 7, 8, 9]], outs):
        ids = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        expected = hf_greedy(model, ids, 10)
        assert out.prompt_token_ids == ids
        assert out.token_ids == expected
        assert out.text == tok.decode(expected, skip_special_tokens=True)
        assert out.finish_reason == "length"
    assert [len(o.token_ids) for o in ordered] == [7, 1, 4]
    assert [o.prompt_token_ids[0] for o in ordered] == [1, 4, 10]
    assert too_long.finish_reason == "error" and too_long.outputs[0].error
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass  # gone, as it should be
    assert not os.path.exists(run_dir)
