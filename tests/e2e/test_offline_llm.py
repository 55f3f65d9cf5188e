"""The offline API: LLM.generate runs the real scheduler and worker processes, no frontend."""

from __future__ import annotations

import os

import psutil
import pytest

from support.oracle import hf_greedy, hf_tokenizer
from pagedserve.offline.llm import LLM, SamplingParams

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
        with pytest.raises(ValueError, match="max_model_len"):  # as vLLM's, before anything is sent
            llm.generate([[3] * 600], SamplingParams(max_tokens=2), use_tqdm=False)
    for prompt, out in zip(PROMPTS + [[5, 6, 7, 8, 9]], outs):
        ids = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        expected = hf_greedy(model, ids, 10)
        assert out.prompt_token_ids == ids
        assert out.token_ids == expected
        assert out.text == tok.decode(expected, skip_special_tokens=True)
        assert out.finish_reason == "length"
    assert [len(o.token_ids) for o in ordered] == [7, 1, 4]
    assert [o.prompt_token_ids[0] for o in ordered] == [1, 4, 10]
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass  # gone, as it should be
    assert not os.path.exists(run_dir)


@pytest.mark.slow
def test_a_bfloat16_checkpoint_without_onednn_bfloat16_runs_in_float32_and_matches_transformers_there(
        model_factory):
    from pagedserve.runtime.cpu_dtype import fast_bfloat16_matmuls

    if fast_bfloat16_matmuls():
        pytest.skip("oneDNN multiplies bfloat16 on this CPU: auto keeps bfloat16 (tests/e2e/test_serve_options.py)")
    model = model_factory("qwen2", dtype="bfloat16")  # as downloaded: bfloat16 weights, a config that says so
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(model, num_gpu_blocks=64, max_model_len=512) as llm:  # dtype auto, as a user starts it
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    tok = hf_tokenizer(model)
    for prompt, out in zip(PROMPTS, outs):
        # transformers in float32 on the same bfloat16 weights: equal only if the engine computed in float32
        assert out.token_ids == hf_greedy(model, tok(prompt).input_ids, 10)
