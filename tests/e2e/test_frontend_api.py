"""The frontend as a real process, driven over HTTP, with fake schedulers on real sockets."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import zmq

from pagedserve.protocol.codec import encode
from pagedserve.protocol.messages import SchedulerStats
from pagedserve.protocol.zmq_io import Endpoints
from support.frontend_harness import API_KEY, MAX_MODEL_LEN

pytestmark = pytest.mark.slow  # a real frontend process


def _client(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=20)


def test_completion_stream_and_non_stream_return_the_same_text(env):
    frontend, fakes, tokenizer = env
    client = _client(frontend)
    full = client.completions.create(model="tiny", prompt="Hello", max_tokens=20)
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].text == streamed == "Hello, world! How are you today?"
    assert full.choices[0].finish_reason == "stop" and full.object == "text_completion"
    assert full.id.startswith("cmpl-")
    reply_tokens = len(tokenizer.encode(streamed)) + 1  # the EOS counts, unrendered
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (
        len(tokenizer.encode("Hello")), reply_tokens)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_stream_and_non_stream_return_the_same_text_from_the_chat_template(env):
    frontend, fakes, tokenizer = env
    client = _client(frontend)
    messages = [{"role": "user", "content": "Hi there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == "Hello, world! How are you today?"
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True)["input_ids"]
    sent = [a for f in fakes for a in f.added if a.request_id == full.id]
    assert sent[0].prompt_token_ids == list(expected)
    assert sent[0].eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_multi_byte_characters_split_across_tokens_stream_without_replacement_chars_one_event_per_token(env):
    frontend, fakes, tokenizer = env
    text = "🎉€ 東京 crème"
    assert len(tokenizer.encode("🎉")) > 1
    for fake in fakes:
        fake.reply_text = text
    chunks = list(_client(frontend).completions.create(
        model="tiny", prompt="Hello", max_tokens=30, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # one event per generated token (the EOS included), even while a character is incomplete
    assert len(chunks) == len(tokenizer.encode(text)) + 1
    assert "" in pieces[:-1]


def test_n_parallel_samples_come_back_as_indexed_choices_with_logprobs(env):
    frontend, _, _ = env
    full = _client(frontend).completions.create(model="tiny", prompt="Hello", max_tokens=20,
                                                n=2, logprobs=1)
    assert [c.index for c in full.choices] == [0, 1]
    assert all(c.text == "Hello, world! How are you today?" for c in full.choices)
    assert full.choices[1].logprobs.token_logprobs[0] == -0.5


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_the_text_and_aborts_the_request(env, stream):
    frontend, fakes, _ = env
    for fake in fakes:
        fake.mode = "hold"  # never finishes by itself: only the stop string can end it
    client = _client(frontend)
    if stream:
        chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=20,
                                                stop=["world"], stream=True))
        text, finish, request_id = ("".join(c.choices[0].text for c in chunks),
                                    chunks[-1].choices[0].finish_reason, chunks[0].id)
    else:
        full = client.completions.create(model="tiny", prompt="Hi", max_tokens=20,
                                         stop="world")
        text, finish, request_id = full.choices[0].text, full.choices[0].finish_reason, full.id
    assert (text, finish) == ("Hello, ", "stop")
    owner = next(f for f in fakes if any(a.request_id == request_id for a in f.added))
    owner.wait_for(lambda f: request_id in f.aborted)


def test_bad_requests_get_a_400_json_error_and_the_server_keeps_serving(env):
    frontend, _, _ = env
    bad_bodies = [
        {"prompt": "Hi", "max_tokens": -1},
        {"prompt": "Hi", "max_tokens": "5"},
        {"prompt": "Hi", "temperature": 2.5},
        {"prompt": "Hi", "top_p": 0},
        {"prompt": "Hi", "n": 0},
        {"prompt": ""},
        {"prompt": "Hi", "model": "no-such-model"},
        {"prompt": list(range(MAX_MODEL_LEN))},
        {"prompt": list(range(40)), "max_tokens": 30},
    ]
    with frontend.client() as http:
        responses = [http.post("/v1/completions", json=b) for b in bad_bodies]
        responses.append(http.post("/v1/completions", content=b"{not json",
                                   headers={"content-type": "application/json"}))
        responses.append(http.post("/v1/chat/completions", json={"messages": "nope"}))
        for response in responses:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
        assert "64" in responses[7].json()["error"]["message"]
        assert "70" in responses[8].json()["error"]["message"]  # 40 + 30 named
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_scheduler_rejects_at_once_gets_a_400(env, stream):
    frontend, fakes, _ = env
    for fake in fakes:
        fake.mode = "reject"
    with frontend.client() as http:
        response = http.post("/v1/completions",
                             json={"prompt": "Hi", "max_tokens": 5, "stream": stream})
    assert response.status_code == 400
    assert "KV blocks" in response.json()["error"]["message"]


def test_api_key_is_required_everywhere_but_health(env):
    frontend, _, _ = env
    for path in ["/v1/models", "/metrics"]:
        assert httpx.get(frontend.base_url + path).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    response = httpx.post(frontend.base_url + "/v1/completions", json={"prompt": "Hi"},
                          headers=wrong)
    assert response.status_code == 401 and response.json()["error"]["message"]
    assert httpx.get(frontend.base_url + "/health").status_code == 200
    assert _client(frontend).models.list().data[0].id == "tiny"


def test_client_disconnect_mid_stream_aborts_the_request(env):
    frontend, fakes, _ = env
    for fake in fakes:
        fake.mode = "hold"
    with frontend.client() as http:
        with http.stream("POST", "/v1/completions",
                         json={"prompt": "Hi", "max_tokens": 30, "stream": True}) as response:
            first = next(response.iter_lines())
            request_id = json.loads(first.removeprefix("data: "))["id"]
    owner = next(f for f in fakes if any(a.request_id == request_id for a in f.added))
    owner.wait_for(lambda f: request_id in f.aborted)


def test_malformed_frames_from_a_scheduler_are_skipped_and_serving_goes_on(env):
    frontend, _, _ = env
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(Endpoints(frontend.run_dir).frontend_outputs())
    try:
        for frame in [b"garbage", encode({"not": "a message"}), b"\x92\x07\xc0",
                      encode(SchedulerStats(replica=7, state="ready"))]:
            push.send(frame)
    finally:
        push.close(linger=1000)
        ctx.term()
    with frontend.client() as http:
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert frontend.proc.poll() is None
