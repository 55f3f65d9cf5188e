"""The offline API as vLLM's quickstart and examples write it: generate and chat, the fields of
what they return (prompt, finished, stop_reason, logprobs as Logprob dicts, cumulative_logprob),
a tqdm factory for ``use_tqdm``, parameters set after construction, and calls from two threads.
On the session's shared LLM, built as the quickstart builds one (support/shared_deployments.py)."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

import pytest

from support.oracle import hf_greedy, hf_tokenizer
from pagedserve import SamplingParams, StructuredOutputsParams
from support.shared_deployments import GPU_MEMORY_UTILIZATION

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen2")


@pytest.fixture(scope="module")
def llm(shared_llm):
    return shared_llm


def test_quickstart_generate_returns_prompts_finished_outputs_and_cumulative_logprobs(llm, model):
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, sampling_params=sampling_params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        assert output.prompt == prompt and output.finished
        assert output.prompt_token_ids == tok(prompt).input_ids
        sample = output.outputs[0]
        assert sample.token_ids == hf_greedy(model, output.prompt_token_ids, 6)
        assert sample.finish_reason == "length" and sample.stop_reason is None
        assert math.isclose(sample.cumulative_logprob,
                            sum(lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)))
        assert sample.cumulative_logprob < 0
    by_ids = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.outputs[0].cumulative_logprob is None


def test_stop_reason_names_the_stop_token_or_string_that_ended_the_sample(llm, model):
    ids = hf_greedy(model, [5, 6, 7], 6)
    by_token = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                        stop_token_ids=[ids[2]]), use_tqdm=False)[0]
    assert by_token.outputs[0].finish_reason == "stop"
    assert by_token.outputs[0].stop_reason == ids[2] and by_token.outputs[0].token_ids == ids[:3]
    text = llm.get_tokenizer().decode(ids, skip_special_tokens=True)
    stop = text.strip()[1:3]
    by_string = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                         stop=[stop]), use_tqdm=False)[0]
    assert (by_string.outputs[0].finish_reason, by_string.outputs[0].stop_reason) == ("stop", stop)


def test_chat_renders_conversations_with_the_chat_template_and_generates_greedily(llm, model):
    tok = hf_tokenizer(model)
    conversations = [[{"role": "user", "content": "Hi there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    one = llm.chat(conversations[0], greedy, use_tqdm=False)
    both = llm.chat(conversations, sampling_params=greedy, use_tqdm=False)
    assert len(one) == 1 and len(both) == 2 and one[0].outputs[0].token_ids == both[0].outputs[0].token_ids
    for conversation, output in zip(conversations, both):
        expected = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert output.prompt_token_ids == expected
        assert output.prompt == tok.decode(expected, skip_special_tokens=False)
        assert output.outputs[0].token_ids == hf_greedy(model, expected, 5)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "no role"}], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content.*surrogate"):
        llm.chat([{"role": "user", "content": "a\ud800"}], greedy, use_tqdm=False)
    assert llm.chat(conversations[0], greedy, use_tqdm=False)[0].outputs[0].token_ids == one[0].outputs[0].token_ids


def test_gpu_memory_utilization_is_the_share_of_ram_the_kv_cache_takes_on_cpu(llm, model):
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = config["num_hidden_layers"] * 2 * 16 * config["num_key_value_heads"] * head_dim * 4  # fp32
    blocks = llm.refresh_stats()[0].num_gpu_blocks
    assert blocks == int(psutil.virtual_memory().total * GPU_MEMORY_UTILIZATION) // block_bytes


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(llm):
    tok = llm.get_tokenizer()
    special_id = next(i for i in tok.all_special_ids if i not in llm.eos_token_ids)
    forced = dict(max_tokens=2, logit_bias={special_id: 100.0}, ignore_eos=True)
    skipped, kept = llm.generate([[5, 6, 7]] * 2, [SamplingParams(**forced),
                                                   SamplingParams(**forced, skip_special_tokens=False)],
                                 use_tqdm=False)
    assert skipped.outputs[0].token_ids == kept.outputs[0].token_ids == [special_id] * 2
    assert skipped.outputs[0].text == "" and kept.outputs[0].text == tok.decode([special_id] * 2)


def test_use_tqdm_may_be_a_callable_that_builds_the_progress_bar(llm):
    from tqdm import tqdm

    built = []

    def bar(*args, **kwargs):
        built.append(kwargs)
        return tqdm(*args, **kwargs, disable=True)

    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=bar)
    assert len(outs) == 2 and len(built) == 1 and built[0]["total"] == 2


def test_an_empty_list_of_sampling_params_is_refused_not_replaced_by_the_defaults(llm):
    with pytest.raises(ValueError, match="lengths of prompts and sampling_params must be the same"):
        llm.generate(["Hello", "Hi"], [], use_tqdm=False, timeout=10)


def test_parameters_set_after_construction_behave_as_if_passed_to_it(llm):
    """vLLM's examples: ``params = llm.get_default_sampling_params(); params.x = ...``."""
    sp = llm.get_default_sampling_params()
    sp.max_tokens, sp.stop_token_ids = 8, None  # room for either choice
    sp.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate("Hello", sp, use_tqdm=False, timeout=30)[0]
    assert out.outputs[0].text in ("yes", "no")
    sp.best_of = 4
    with pytest.raises(ValueError, match="^best_of"):
        llm.generate("Hello", sp, use_tqdm=False, timeout=30)


def test_two_threads_generating_at_once_take_turns_and_each_gets_its_own_results(llm):
    def run(max_tokens: int) -> list[int]:
        outs = llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False, timeout=60)
        return [len(o.outputs[0].token_ids) for o in outs]

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.submit(run, 30), pool.submit(run, 31)
        assert (first.result(timeout=120), second.result(timeout=120)) == ([30, 30], [31, 31])
    assert time.monotonic() - started < 120
