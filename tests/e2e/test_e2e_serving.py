"""Through real processes: HTTP -> frontend -> scheduler -> worker -> tokens, equal to transformers.

On the session's shared server (qwen2); the other families are covered by test_models_e2e.py and
test_model_parity.py."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from support.greedy import client
from support.oracle import hf_greedy, hf_tokenizer, prompt_whose_greedy_output_ends_at_eos
from support.server import Server, pagedserve_processes, wait_until
from support.shared_deployments import SERVER_CACHE_TOKENS, SERVER_MAX_MODEL_LEN

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. A paged attention engine keeps",
    "東京は",
    "def main():\n    return 42\n" * 3,
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Émile ate crème brûlée in Zürich; " * 2,
]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def model_name(srv: Server) -> str:
    return client(srv).models.list().data[0].id


def test_concurrent_greedy_completions_equal_transformers_generate(server):
    tok = hf_tokenizer(server.model)
    prompts = [tok(p).input_ids for p in PROMPTS]
    c, name = client(server), model_name(server)

    def complete(ids):
        r = c.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, prompts))
    for ids, (text, n) in zip(prompts, results):
        expected = hf_greedy(server.model, ids, 12)
        assert n == 12
        assert text == tok.decode(expected, skip_special_tokens=True)


def test_greedy_generation_stops_at_the_eos_token_where_transformers_stops(server):
    # a prompt whose greedy continuation really reaches EOS (a text prompt never does here)
    ids, expected = prompt_whose_greedy_output_ends_at_eos(server.model, 40)
    tok = hf_tokenizer(server.model)
    r = client(server).completions.create(model=model_name(server), prompt=ids, max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(expected) < 40  # the EOS token itself is the last one counted
    assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)


def test_a_client_that_names_the_model_by_its_path_is_served_as_vllm_serves_it(server):
    # `vllm serve /models/x` serves "/models/x", and `vllm bench serve --model PATH` sends that
    c = client(server)
    assert [m.id for m in c.models.list().data] == [Path(server.model).name]  # the primary name only
    for chat in (False, True):
        kw = dict(model=str(server.model), max_tokens=2, temperature=0)
        r = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw) if chat else \
            c.completions.create(prompt="hi", **kw)
        assert r.model == Path(server.model).name and r.usage.completion_tokens >= 1


def test_streaming_returns_the_same_text_as_non_streaming(server):
    c, name = client(server), model_name(server)
    kw = dict(model=name, prompt=PROMPTS[4], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == whole


def test_chat_completion_uses_the_chat_template(server):
    tok = hf_tokenizer(server.model)
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    expected = hf_greedy(server.model, list(ids), 8)
    r = client(server).chat.completions.create(model=model_name(server), messages=messages, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)


def test_bad_requests_get_400_with_a_message_and_serving_continues(server):
    url = server.url + "/v1/completions"
    name = model_name(server)
    bad = [
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30),
        httpx.post(url, json={"model": name, "prompt": "hi", "max_tokens": -1}, timeout=30),
        httpx.post(url, json={"model": name, "prompt": "hi " * 1600, "max_tokens": 4}, timeout=30),
        # fits --max-model-len (1536) but needs more blocks than the 80 x 16-token cache holds
        httpx.post(url, json={"model": name, "prompt": [5] * 1400, "max_tokens": 4}, timeout=30),
    ]
    assert SERVER_CACHE_TOKENS < 1400 + 4 <= SERVER_MAX_MODEL_LEN < 1600
    for resp in bad:
        assert resp.status_code == 400, resp.text
        assert json.loads(resp.text)["error"]["message"]
    r = client(server).completions.create(model=name, prompt="Hello", max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def _worker_seconds(srv: Server) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^pagedserve_worker_(forward|idle)_seconds_total(?:\{[^}]*\})? (\S+)$", text, re.M)}


def test_metrics_show_worker_forward_and_idle_seconds_within_the_wall_time(server):
    c, name = client(server), model_name(server)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: c.completions.create(model=name, prompt=p, max_tokens=16, temperature=0,
                                                     extra_body={"ignore_eos": True}), PROMPTS[:4]))
    # the counters travel in the scheduler's stats, sent every 0.5 s: poll until they arrive
    def both_positive():
        seconds = _worker_seconds(server)
        return set(seconds) == {"forward", "idle"} and min(seconds.values()) > 0

    assert wait_until(both_positive, 10), _worker_seconds(server)
    seconds = _worker_seconds(server)
    wall = time.time() - psutil.Process(server.proc.pid).create_time()
    assert seconds["forward"] + seconds["idle"] <= wall


def test_sigterm_to_the_supervisor_leaves_no_pagedserve_process(model_factory, tmp_path):
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "32"]).start(tmp_path)
    assert len(srv.pids()) >= 4  # supervisor, frontend, scheduler, worker
    srv.stop()
    assert srv.proc.returncode == 0
    assert wait_until(lambda: not pagedserve_processes(srv.run_dir_parent), 10)
