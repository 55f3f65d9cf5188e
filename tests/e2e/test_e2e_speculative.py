"""Speculative decoding end to end: ``--speculative-config`` (vLLM's JSON) on a served model
and ``LLM(speculative_config={...})`` give transformers' greedy tokens; the spec-decode metrics
move under vLLM's names and pagedserve's, with prompt lookup and with a draft model; a stop string that falls inside a run of accepted
proposals ends the stream there, with nothing after it; and what cannot run is refused in one line.
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
