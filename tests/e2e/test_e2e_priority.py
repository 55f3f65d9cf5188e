"""Scheduling policies through real processes and the official openai and anthropic clients: a
high-priority request overtakes a saturated low-priority queue; load shedding answers 429 with
Retry-After on every generation surface, each in its own error shape; the offline LLM takes the
same field and refuses the same way (ValueError)."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest

from support.server import Server

pytestmark = pytest.mark.slow

COMMON = ["--num-gpu-blocks", "128", "--max-model-len", "512", "--max-num-batched-tokens", "128",
          "--debug-invariants"]


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _start_streams(srv: Server, count: int, max_tokens, priority: int = 0) -> tuple[list, list]:
    """``count`` streamed completions in threads; each one's time of its first chunk (None before).
    ``max_tokens``: one for all, or a list of one per stream."""
    first = [None] * count
    c = client(srv)
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * count

    def run(i: int) -> None:
        stream = c.completions.create(model="m", prompt=f"stream {i} says", max_tokens=lengths[i], stream=True,
                                      extra_body={"ignore_eos": True, **({"priority": priority} if priority else {})})
        for _ in stream:
            if first[i] is None:
                first[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # arrival order = index order
    return threads, first


def test_a_high_priority_request_overtakes_a_saturated_low_priority_queue(model_factory, tmp_path):
    srv = Server(model_factory("qwen2"), [*COMMON, "--max-num-seqs", "2", "--scheduling-policy", "priority",
                                          "--served-model-name", "m"]).start(tmp_path)
    try:
        threads, first = _start_streams(srv, 6, max_tokens=400, priority=10)
        deadline = time.monotonic() + 60
        while sum(t is not None for t in first) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        health = httpx.get(srv.url + "/health").json()
        assert health["scheduling_policy"] == "priority"
        r = client(srv).completions.create(model="m", prompt="urgent", max_tokens=4,
                                           extra_body={"priority": 0, "ignore_eos": True})
        done = time.monotonic()
        assert r.usage.completion_tokens == 4
        # it did not wait for the two running low streams to finish, nor behind the four queued
        assert sum(t is None or t > done for t in first) >= 3, first
        replica = httpx.get(srv.url + "/health").json()["replicas"][0]
        assert replica["scheduling_policy"] == "priority"
        assert set(replica["num_waiting_by_priority"]) <= {"10"}  # JSON keys
        for t in threads:
            t.join(timeout=120)
        assert all(t is not None for t in first)
    finally:
        srv.stop()


def test_fcfs_refuses_a_priority_and_sheds_past_max_waiting_requests(model_factory, tmp_path):
    srv = Server(model_factory("qwen2"), [*COMMON, "--max-num-seqs", "1", "--max-waiting-requests", "2",
                                          "--max-model-len", "2048", "--served-model-name", "m"]).start(tmp_path)
    try:
        c = client(srv)
        with pytest.raises(openai.BadRequestError) as refused:
            c.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"priority": 3})
        assert refused.value.body["param"] == "priority"
        assert "--scheduling-policy priority" in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      extra_body={"priority": -1})
        c.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"priority": 0})  # the default is fine
        # One runs (long enough to hold the seat through the refusals below), two wait: the limit.
        threads, first = _start_streams(srv, 3, max_tokens=[1800, 8, 8])
        deadline = time.monotonic() + 60
        while "vllm:num_requests_waiting{model_name=\"m\"} 2.0" not in httpx.get(srv.url + "/metrics").text:
            assert time.monotonic() < deadline, "the frontend never saw two requests waiting"
            time.sleep(0.02)  # the next stats heartbeat
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as shed:
            c.completions.create(model="m", prompt="one too many", max_tokens=2, stream=True)
        assert shed.value.response.status_code == 429
        assert int(shed.value.response.headers["retry-after"]) >= 1
        assert "--max-waiting-requests" in shed.value.body["message"]
        assert shed.value.body["code"] == "overloaded"
        # the Responses and Messages APIs at the door too, each in the error shape its client parses
        with pytest.raises(openai.RateLimitError) as responses_shed:
            c.responses.create(model="m", input="one too many", max_output_tokens=2)
        assert responses_shed.value.body["code"] == "overloaded"
        claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        with pytest.raises(anthropic.RateLimitError) as messages_shed:
            claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "one too many"}])
        assert messages_shed.value.body["type"] == "error"
        assert messages_shed.value.type == "rate_limit_error"
        assert "--max-waiting-requests" in messages_shed.value.api_message
        assert int(messages_shed.value.response.headers["retry-after"]) >= 1
        assert time.monotonic() - started < 3.0  # three refusals, none queued
        # refused at the door (early_shed.py), still counted per class; what it cannot judge goes on to a 400
        with pytest.raises(openai.BadRequestError) as malformed:
            c.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"priority": "high"})
        assert malformed.value.body["param"] == "priority"
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'pagedserve_requests_shed_by_priority_total{model_name="m",priority="0"} 3.0' in metrics
        for t in threads:  # nothing admitted was affected
            t.join(timeout=120)
        assert all(t is not None for t in first)
    finally:
        srv.stop()


def test_offline_priority_list_and_its_errors(model_factory):
    from pagedserve import LLM, SamplingParams

    model = model_factory("qwen2")
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with LLM(model, num_gpu_blocks=64, max_model_len=256, scheduling_policy="priority", max_num_seqs=1) as llm:
        outs = llm.generate(["a", "b", "c"], greedy, use_tqdm=False, priority=[3, 0, 1])
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
        with pytest.raises(ValueError, match="priority: 2 priorities for 3 prompts"):
            llm.generate(["a", "b", "c"], greedy, use_tqdm=False, priority=[1, 2])
        with pytest.raises(ValueError, match="priority"):
            llm.generate(["a"], greedy, use_tqdm=False, priority=["high"])
    with LLM(model, num_gpu_blocks=64, max_model_len=256) as llm:  # fcfs
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            llm.generate(["a", "b"], greedy, use_tqdm=False, priority=[0, 1])
        assert len(llm.generate(["a"], greedy, use_tqdm=False, priority=[0])) == 1
