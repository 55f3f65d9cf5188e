"""Speculative decoding end to end: ``--speculative-config`` (vLLM's JSON) on a served model
and ``LLM(speculative_config={...})`` give transformers' greedy tokens; the spec-decode metrics
move under vLLM's names and pagedserve's, with prompt lookup and with a draft model; a stop string that falls inside a run of accepted
proposals ends the stream there, with nothing after it returned or counted; a draft is still accepted on blocks it never
computed; and what cannot run is refused in one line.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from pagedserve.offline.llm import LLM, SamplingParams

from support.greedy import assert_equal_to_transformers, greedy_completions
from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server

pytestmark = pytest.mark.slow

# Backoff by acceptance alone: on the demo model a row costs about what a step does, so the default
# (by expected gain, priced from the steps' clock) would rightly stop proposing, and these tests are
# about what proposals do. The priced backoff has its own tests (tests/unit/test_scheduler_speculation_cost.py).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "backoff": "acceptance"}
PROMPTS = [[11, 12, 13, 14, 15] * 3, [5] * 6, [7, 8, 9, 10, 11, 12, 13, 7, 8]]  # [5] * 6: its output repeats
MAX_TOKENS = 48


def _counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)
    assert match, name
    return float(match.group(1))


def _spec_counters(srv: Server) -> list[tuple[float, float, float, float]]:
    """(drafts, proposed, accepted, accepted at the first position), under vLLM's names and ours,
    once a stats heartbeat (every 0.5 s) has brought any verification to the frontend."""
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(srv.url + "/metrics").text
        counters = [tuple(_counter(metrics, f"{prefix}spec_decode_{name}_total") for name in names)
                    for prefix in ("vllm:", "pagedserve_")]
        if all(c[0] > 0 for c in counters) or time.monotonic() > deadline:
            return counters
        time.sleep(0.05)


def _stop_string(model: str, tokens: list[int], where=lambda ends: True) -> tuple[str, int]:
    """A 3-character stop string from the second half of ``tokens``' text, and how many tokens
    end with it: the one that completes it included. None with U+FFFD, which a partial decode
    shows for a character whose bytes have not all come (the detokenizer waits for them)."""
    decode = hf_tokenizer(model).decode
    text = decode(tokens, skip_special_tokens=True)
    for i in range(len(text) // 2, len(text) - 3):
        stop = text[i:i + 3]
        if "\ufffd" in stop:
            continue
        ends = next(j for j in range(1, len(tokens) + 1) if stop in decode(tokens[:j], skip_special_tokens=True))
        if ends < len(tokens) and where(ends):
            return stop, ends
    raise AssertionError("no stop string fits")


def test_served_greedy_equals_transformers_metrics_move_and_a_stop_string_ends_an_accepted_run(
        model_factory, tmp_path):
    model = model_factory("qwen2")
    srv = Server(model, ["--speculative-config", json.dumps(SPEC), "--debug-invariants", "--num-gpu-blocks", "128",
                         "--max-model-len", "512", "--served-model-name", "m"]).start(tmp_path)
    try:
        assert_equal_to_transformers(model, PROMPTS, greedy_completions(srv, PROMPTS, MAX_TOKENS), MAX_TOKENS)
        for drafts, proposed, accepted, first in _spec_counters(srv):
            assert 0 < accepted <= proposed and drafts > 0 and 0 < first <= drafts

        # A stop string inside the greedy text: the stream ends right before it, whatever run
        # of accepted proposals carried it, and nothing streams after the end.
        text = hf_tokenizer(model).decode(hf_greedy(model, PROMPTS[0], MAX_TOKENS), skip_special_tokens=True)
        stop = text[len(text) // 2:len(text) // 2 + 3]
        want = text[:text.index(stop)]
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        chunks = list(c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                           stop=[stop], stream=True, extra_body={"ignore_eos": True}))
        finished = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].finish_reason]
        assert len(finished) == 1 and chunks[finished[0]].choices[0].finish_reason == "stop"
        assert all(not ch.choices or not ch.choices[0].text for ch in chunks[finished[0] + 1:])
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        # usage counts the tokens up to the one that completes the stop string, none accepted after it
        stop, ends = _stop_string(model, hf_greedy(model, PROMPTS[0], MAX_TOKENS))
        done = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
        assert done.choices[0].text == text[:text.index(stop)] and done.usage.completion_tokens == ends
    finally:
        srv.stop()


def test_offline_llm_takes_vllms_speculative_config_and_refuses_what_it_cannot_run(model_factory):
    model = model_factory("qwen2")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model, speculative_config=SPEC, num_gpu_blocks=64, max_model_len=256, debug_invariants=True,
             num_threads=1) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        stats = llm.refresh_stats()[0]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    assert stats.spec_decode_num_accepted_tokens > 0
    for method, word in (("eagle", "EAGLE"), ("mtp", "MTP"), ("draft_model", "model")):
        with pytest.raises(ValueError, match=word) as refused:
            LLM(model, speculative_config={"method": method, "num_speculative_tokens": 2})
        assert "\n" not in str(refused.value)
    other_vocab = model_factory("qwen2", vocab_size=640, num_layers=1)
    for draft, extra, words in ((model, {"tensor_parallel_size": 2}, "--tensor-parallel-size"),
                                (other_vocab, {}, "vocabulary of 640")):
        with pytest.raises(ValueError, match=words) as refused:
            LLM(model, speculative_config={"model": draft, "num_speculative_tokens": 2}, **extra)
        assert "\n" not in str(refused.value)


def test_served_greedy_with_a_draft_model_equals_transformers_and_the_metrics_move(model_factory, tmp_path):
    model = model_factory("qwen2")
    draft = model_factory("qwen2", num_layers=1, hidden_size=32, intermediate_size=64, seed=7)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "backoff": "acceptance"}
    srv = Server(model, ["--speculative-config", json.dumps(spec), "--debug-invariants", "--num-gpu-blocks", "128",
                         "--max-model-len", "512", "--served-model-name", "m"]).start(tmp_path)
    try:
        assert_equal_to_transformers(model, PROMPTS, greedy_completions(srv, PROMPTS, MAX_TOKENS), MAX_TOKENS)
        for drafts, proposed, accepted, _ in _spec_counters(srv):
            assert proposed >= drafts > 0 and accepted <= proposed
    finally:
        srv.stop()


def test_a_draft_that_is_the_target_keeps_being_accepted_on_blocks_it_never_computed_and_a_stop_string_ends_its_run(
        model_factory):
    """The target as its own draft proposes what the target samples: acceptance stays high where
    the draft's cache lacks a context (blocks a request that did not speculate computed, reused
    from the prefix cache; the prompt of an n = 2 request's parent), since the draft computes the
    missing positions first; before, its proposals from an unseen context were all rejected. And a
    stop string inside a run of accepted tokens ends the output at the token that completes it:
    the accepted tokens after it are neither returned nor counted."""
    model = model_factory("qwen2")
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 4, "backoff": "acceptance"}
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    blocks_from_logprobs = [(i * 37 + 11) % 500 + 3 for i in range(80)]
    for_two = [(i * 53 + 7) % 500 + 3 for i in range(40)]
    with LLM(model, speculative_config=spec, enable_prefix_caching=True, num_gpu_blocks=64, max_model_len=256,
             debug_invariants=True, num_threads=1) as llm:
        def accepted_share(prompt, params):
            before = llm.refresh_stats()[0]
            outs = llm.generate([prompt], params, use_tqdm=False)[0].outputs
            after = llm.refresh_stats()[0]
            proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            assert proposed > 0
            return (after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens) / proposed, outs

        # logprobs turn speculation off for this request: the blocks it computes have no draft keys
        llm.generate([blocks_from_logprobs], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1),
                     use_tqdm=False)
        share, outs = accepted_share(blocks_from_logprobs, greedy)
        assert share > 0.8 and outs[0].token_ids == hf_greedy(model, blocks_from_logprobs, MAX_TOKENS)
        share, outs = accepted_share(for_two, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2,
                                                              ignore_eos=True))
        assert share > 0.8 and [o.token_ids for o in outs] == [hf_greedy(model, for_two, MAX_TOKENS)] * 2

        tokens = hf_greedy(model, PROMPTS[0], MAX_TOKENS)
        text = hf_tokenizer(model).decode(tokens, skip_special_tokens=True)
        # after the prompt's token, every step accepts its 4 proposals: 1 + 5m tokens end a step, so
        # a stop string that ends elsewhere ends inside a run of accepted tokens
        stop, ends = _stop_string(model, tokens, lambda ends: (ends - 1) % 5 != 0)
        _, outs = accepted_share(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                            stop=[stop]))
        assert outs[0].text == text[:text.index(stop)] and outs[0].finish_reason == "stop"
        assert outs[0].token_ids == tokens[:ends]
