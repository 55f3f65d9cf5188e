"""The offline API never hangs and never breaks: every bad input raises within seconds and the
same LLM keeps serving; a frame that slips past the checks is answered by the scheduler; a
killed worker is replaced; and offline text equals the HTTP frontend's for the same prompts and
sampling."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import httpx
import msgspec
import pytest

from support.oracle import hf_greedy
from support.shared_deployments import LLM_MAX_MODEL_LEN

from pagedserve.offline.llm import LLM, SamplingParams
from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import PROTOCOL_VERSION

pytestmark = pytest.mark.slow

VOCAB = 512  # the demo model's
MAX_MODEL_LEN = LLM_MAX_MODEL_LEN  # the shared LLM's, and the worker-kill test's own
PROMPT = [42, 353, 7, 99]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen2")


@pytest.fixture(scope="module")
def llm(shared_llm):
    """The session's shared LLM (max_num_seqs 8: n=9 is refused), with its scheduler's pid as this module began."""
    shared_llm.scheduler_pid = next(c.popen.pid for c in shared_llm._children if c.role == "scheduler")
    return shared_llm


@pytest.fixture
def own_llm(model):
    """The worker-kill test's own engine: the shared one's later users must not see the kill."""
    with LLM(model, num_gpu_blocks=256, max_model_len=MAX_MODEL_LEN, max_num_seqs=8) as engine:
        yield engine


BAD_SAMPLING = [dict(logprobs=-1), dict(logprobs=2000), dict(logprobs="x"), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3), dict(frequency_penalty=math.nan), dict(repetition_penalty=0),
                dict(repetition_penalty=2.5), dict(min_p=1.5), dict(min_p=-0.1), dict(logit_bias={1: 101}),
                dict(logit_bias={-1: 1.0}), dict(logit_bias="x"), dict(prompt_logprobs=-1), dict(prompt_logprobs="x"), dict(best_of=3), dict(temperature="x"), dict(temperature=math.nan), dict(temperature=-1),
                dict(top_p=math.nan), dict(top_p=0), dict(top_k=-2), dict(top_k=2**70), dict(seed=2**63),
                dict(seed=2**70), dict(seed=1.5), dict(n=0), dict(n=10**30), dict(max_tokens=0),
                dict(max_tokens=2**70), dict(max_tokens=True), dict(min_tokens=-1), dict(min_tokens=100),
                dict(stop_token_ids=[2**63]), dict(stop_token_ids=[10**30]), dict(stop_token_ids=[-1]),
                dict(stop_token_ids="x"), dict(stop=[""]), dict(stop=5), dict(ignore_eos="no"),
                dict(stop=["a\ud800"]), dict(structured_outputs={"regex": "\udfff"}),
                dict(structured_outputs={"json": {"type": "string", "const": "\ud800"}})]


@pytest.mark.parametrize("kwargs", BAD_SAMPLING, ids=[str(k)[:40] for k in BAD_SAMPLING])
def test_bad_sampling_params_raise_value_error_naming_the_field(kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(next(iter(kwargs)))


BAD_PROMPTS = [[VOCAB], [-1], [2**63], [2**70], [1.5], [], "", {"prompt": 5}, {"x": [1]},
               {"prompt": "a", "prompt_token_ids": [1]}, {"prompt_token_ids": "abc"}, None, "x\ud800",
               {"prompt": "\udfff y"}]


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=[str(p)[:30] for p in BAD_PROMPTS])
def test_a_bad_prompt_raises_at_once_and_the_llm_keeps_working(llm, prompt):
    started = time.monotonic()
    with pytest.raises(ValueError):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False, timeout=10)
    with pytest.raises(ValueError, match="stop_token_ids"):  # needs the vocabulary: checked at generate
        llm.generate([PROMPT], SamplingParams(stop_token_ids=[VOCAB]), use_tqdm=False, timeout=10)
    with pytest.raises(ValueError, match="max_model_len"):  # vLLM raises too: no token would fit
        llm.generate([PROMPT, [3] * MAX_MODEL_LEN], SamplingParams(), use_tqdm=False, timeout=10)
    assert time.monotonic() - started < 10


def test_seed_none_is_vllms_no_fixed_seed(model):
    with LLM(model, seed=None, num_gpu_blocks=64, max_model_len=64, num_threads=1) as engine:
        out = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # it started (a TypeError at start before)


def test_more_samples_than_max_num_seqs_raise_naming_n_before_anything_is_sent(llm):
    started = time.monotonic()
    with pytest.raises(ValueError, match="^n: n=9 parallel samples exceed max_num_seqs=8"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(n=2), SamplingParams(n=9)], use_tqdm=False, timeout=10)
    assert time.monotonic() - started < 10
    (fits,) = llm.generate([PROMPT], [SamplingParams(n=8, max_tokens=2)], use_tqdm=False, timeout=30)
    assert [o.finish_reason for o in fits.outputs] == ["length"] * 8


def _raw_add_request(request_id: str, **fields) -> bytes:
    body = {"type": "AddRequest", "request_id": request_id, "prompt_token_ids": PROMPT,
            "sampling": {"max_tokens": 2}, **fields}
    return msgspec.msgpack.encode((PROTOCOL_VERSION, body))


def _error_for(llm: LLM, request_id: str, timeout_s: float = 10) -> m.RequestDelta:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = llm._outputs.recv(timeout_ms=100)
        if isinstance(msg, m.RequestOutputs):
            for delta in m.iter_deltas(msg):
                if delta.request_id == request_id:
                    return delta
    raise AssertionError(f"no answer for {request_id} within {timeout_s}s")


def test_the_scheduler_answers_a_frame_that_skipped_the_checks_and_stays_up(llm):
    """A buggy client's frames: out of the protocol's ranges, or outside the vocabulary."""
    inputs = llm._inputs[0]
    inputs.send_bytes(_raw_add_request("raw-stop", sampling={"max_tokens": 2, "stop_token_ids": [2**63]}))
    delta = _error_for(llm, "raw-stop")
    assert delta.finish_reason == "error" and delta.error_kind == "invalid_request" and "stop_token_ids" in delta.error
    inputs.send_bytes(_raw_add_request("raw-oov", prompt_token_ids=[1, VOCAB]))  # in range, not in the vocabulary
    delta = _error_for(llm, "raw-oov")
    assert delta.finish_reason == "error" and "vocabulary" in delta.error
    assert next(c for c in llm._children if c.role == "scheduler").popen.poll() is None


def test_offline_logprobs_are_vllm_logprob_dicts_and_penalties_and_bias_are_honoured(llm, model):
    import torch

    from support.oracle import hf_model as load_hf_model
    hf_model = load_hf_model(model)
    expected = hf_greedy(model, PROMPT, 3)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2),
                       use_tqdm=False, timeout=30)[0].outputs[0]
    assert out.token_ids == expected
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + expected])).logits[0, len(PROMPT) - 1:-1]
    for token, entry, reference in zip(out.token_ids, out.logprobs, torch.log_softmax(logits.float(), -1)):
        values, ids = reference.topk(2)
        assert list(entry)[0] == token and set(entry) == {token, *ids.tolist()}  # vLLM's order: sampled first
        assert [entry[i].logprob for i in ids.tolist()] == pytest.approx(values.tolist(), abs=1e-4)
        assert [entry[i].rank for i in ids.tolist()] == [1, 2]  # greedy: the sampled token is the first
        assert entry[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=True)
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True),
                         use_tqdm=False, timeout=30)[0].outputs[0]
    assert len(plain.logprobs) == 3  # True counts as 1 (vLLM's): the greedy token is that one alternative
    assert [list(lp) for lp in plain.logprobs] == [[t] for t in plain.token_ids]
    assert [lp[t].rank for t, lp in zip(plain.token_ids, plain.logprobs)] == [1, 1, 1]
    forced = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, logit_bias={7: 100.0}),
                          use_tqdm=False, timeout=30)[0].outputs[0]
    assert forced.token_ids == [7, 7, 7]
    too_big = SamplingParams(logit_bias={VOCAB: 1.0})  # the vocabulary is known only to the LLM
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate(PROMPT, too_big, use_tqdm=False, timeout=30)


def test_every_prompt_form_works_and_the_same_processes_still_give_the_right_tokens(llm, model):
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    text = llm.tokenizer.decode(PROMPT)
    forms = [PROMPT, {"prompt_token_ids": PROMPT}, {"prompt": text}, text]
    outs = llm.generate(forms, greedy, use_tqdm=False, timeout=30)
    expected = hf_greedy(model, PROMPT, 5)
    assert [o.token_ids for o in outs[:2]] == [expected, expected]
    assert outs[2].token_ids == outs[3].token_ids
    single = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False, timeout=30)
    assert single[0].token_ids == expected
    assert next(c for c in llm._children if c.role == "scheduler").popen.pid == llm.scheduler_pid


def test_offline_and_http_give_the_same_text_and_tokens_for_the_same_sampling(llm, shared_server):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False, timeout=30)[0]
    stop_token = base.token_ids[6]
    text = base.text
    stop_string = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                       if text[i:i + 2].strip() == text[i:i + 2])
    configs = [dict(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token]),
               dict(max_tokens=24, temperature=0.0, stop=[stop_string], ignore_eos=True),
               dict(max_tokens=24, temperature=0.9, seed=7, stop=["zz", stop_string]),
               dict(max_tokens=24, temperature=0.9, seed=11)]
    offline = llm.generate([PROMPT] * len(configs), [SamplingParams(**c) for c in configs],
                           use_tqdm=False, timeout=60)
    for config, out in zip(configs, offline):  # the shared server serves the same model
        r = httpx.post(shared_server.url + "/v1/completions", timeout=60, json={"prompt": PROMPT, **config})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (out.text, out.finish_reason) == (choice["text"], choice["finish_reason"]), config
        assert len(out.token_ids) == r.json()["usage"]["completion_tokens"], config
    assert offline[0].token_ids[-1] == stop_token and offline[0].finish_reason == "stop"
    assert offline[1].finish_reason == "stop" and stop_string not in offline[1].text


def test_a_worker_killed_during_generate_ends_its_requests_within_seconds_and_is_replaced(own_llm, model):
    worker = next(c.popen.pid for c in own_llm._children if c.role == "worker")

    def kill_once_running() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (0 in own_llm.stats and own_llm.stats[0].num_running > 0):
            time.sleep(0.02)  # polls the stats generate() keeps current
        os.kill(worker, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_running)
    killer.start()
    started = time.monotonic()
    # Four waves of max_num_seqs requests: seconds of work on any machine, so the kill (after the
    # stats first show a running request, up to a heartbeat late) lands while requests run.
    outs = own_llm.generate([PROMPT] * 32, SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False, timeout=60)
    elapsed = time.monotonic() - started
    killer.join()
    assert elapsed < 20
    assert any(o.finish_reason == "error" for o in outs), [o.finish_reason for o in outs]
    assert all(o.finish_reason in ("error", "length") for o in outs)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert own_llm.generate([PROMPT], greedy, use_tqdm=False, timeout=60)[0].token_ids == hf_greedy(model, PROMPT, 4)
    assert own_llm.worker_restarts == 1
    assert worker not in [c.popen.pid for c in own_llm._children]
