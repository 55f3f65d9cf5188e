"""/v1/completions as vLLM users call it: several prompts, echo, stop_reason; chat's refusal.

A real frontend process over fake schedulers (test_frontend_harness.py), driven with the
official openai client. The fake answers every request with the same reply text.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, CompletionRequest
from pagedserve.frontend_proc.request_fields import ABOUT_THE_CALLER, REASONS

from support.frontend_harness import API_KEY

pytestmark = pytest.mark.slow
REPLY = "Hello, world! How are you today?"


def _client(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=20)


def _sent(fakes, request_id_prefix: str):
    return sorted((a for f in fakes for a in f.added if a.request_id.startswith(request_id_prefix)),
                  key=lambda a: a.request_id)


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gets_n_choices_each_numbered_prompt_major(env, stream):
    frontend, fakes, tokenizer = env
    prompts = ["Hello", "A longer second prompt"]
    args = dict(model="tiny", prompt=prompts, max_tokens=20, n=2)
    if stream:
        chunks = list(_client(frontend).completions.create(
            **args, stream=True, stream_options={"include_usage": True}))
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        response_id, usage = chunks[0].id, chunks[-1].usage
    else:
        full = _client(frontend).completions.create(**args)
        assert [c.index for c in full.choices] == [0, 1, 2, 3]
        texts = {c.index: c.text for c in full.choices}
        response_id, usage = full.id, full.usage
    assert texts == {i: REPLY for i in range(4)}
    sent = _sent(fakes, response_id)
    assert [a.prompt_token_ids for a in sent] == [tokenizer.encode(p) for p in prompts]
    assert all(a.sampling.n == 2 for a in sent)
    reply_tokens = len(tokenizer.encode(REPLY)) + 1  # the EOS counts, unrendered
    assert usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert usage.completion_tokens == 4 * reply_tokens


def test_echo_puts_each_prompts_text_before_its_choices(env):
    frontend, _, tokenizer = env
    prompts = ["Hi there", " token ids"]
    full = _client(frontend).completions.create(
        model="tiny", prompt=[tokenizer.encode(p) for p in prompts], max_tokens=20, echo=True)
    assert [c.text for c in full.choices] == [p + REPLY for p in prompts]
    chunks = list(_client(frontend).completions.create(model="tiny", prompt="Hi there",
                                                       max_tokens=20, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hi there" + REPLY


@pytest.mark.parametrize("body,param", [
    ({"suffix": "x"}, "suffix"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: not with stream
    ({"prompt": ["a", ""]}, "prompt"),
])
def test_unsupported_combinations_are_a_400_naming_the_field(env, body, param):
    frontend, _, _ = env
    r = httpx.post(f"{frontend.base_url}/v1/completions", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_stop_reason_names_the_stop_string_and_is_null_after_eos(env):
    frontend, fakes, _ = env
    client = _client(frontend)
    by_string = client.completions.create(model="tiny", prompt="Hi", max_tokens=20, stop=["world"])
    assert by_string.choices[0].finish_reason == "stop"
    assert by_string.choices[0].model_extra["stop_reason"] == "world"
    by_eos = client.completions.create(model="tiny", prompt="Hi", max_tokens=20)
    assert by_eos.choices[0].model_extra["stop_reason"] is None


def test_chat_messages_carry_refusal_null_as_openai_schema_requires(env):
    frontend, _, _ = env
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=frontend.headers(),
                   timeout=20, json={"model": "tiny", "max_tokens": 20, "logprobs": True,
                                     "messages": [{"role": "user", "content": "Hi"}]})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "refusal": None}
    assert choice["logprobs"]["refusal"] is None and choice["stop_reason"] is None


OPENAI_SCHEMA = Path(__file__).resolve().parents[3] / "shared" / "openai-openapi" / "openai_subset.json"
VLLM_EXTRAS = sorted(REASONS.keys() - {"tools", "tool_choice", "functions", "function_call", "audio",
                                       "response_format", "modalities", "prediction", "reasoning_effort",
                                       "verbosity", "web_search_options", "store", "service_tier",
                                       "moderation", "prompt_cache_options", "prompt_cache_retention"})


def _request_fields(schema_name: str) -> set[str]:
    schemas = json.loads(OPENAI_SCHEMA.read_text())["components"]["schemas"]
    node = schemas[schema_name]
    names = set(node.get("properties", {}))
    for part in node.get("allOf", []):
        ref = part.get("$ref")
        names |= _request_fields(ref.rsplit("/", 1)[-1]) if ref else set(part.get("properties", {}))
    return names


@pytest.mark.parametrize("path,schema_name,model", [
    ("/v1/completions", "CreateCompletionRequest", CompletionRequest),
    ("/v1/chat/completions", "CreateChatCompletionRequest", ChatCompletionRequest)])
def test_every_openai_request_field_is_declared_about_the_caller_or_refused_by_name(env, path, schema_name, model):
    if not OPENAI_SCHEMA.is_file():
        pytest.skip(f"OpenAI's schema is not at {OPENAI_SCHEMA}")
    frontend, _, _ = env
    base = ({"prompt": "Hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]})
    assert _request_fields(schema_name)  # the schema was read
    undeclared = sorted(_request_fields(schema_name) - set(model.model_fields))  # none left for completions
    # vLLM's extras this server does not declare (a declared one is tested where it is honoured)
    for field in [*undeclared, *(f for f in VLLM_EXTRAS if f not in model.model_fields)]:
        value = {"metadata": {"k": "v"}}.get(field, "some value")
        r = httpx.post(f"{frontend.base_url}{path}", headers=frontend.headers(), timeout=20,
                       json={"model": "tiny", "max_tokens": 3, **base, field: value})
        if field in ABOUT_THE_CALLER:  # describe the caller: nothing in the output to change
            assert r.status_code == 200, (field, r.text)
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
            assert field in r.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [("store", False), ("service_tier", "auto"), ("modalities", ["text"]),
                                         ("tools", None), ("user", "someone")])
def test_a_field_at_its_neutral_value_or_null_is_accepted(env, field, value):
    frontend, _, _ = env
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
                         field: value})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
                         "store": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_skip_special_tokens_false_renders_them_in_the_text(env):
    frontend, fakes, tokenizer = env
    special = next(t for t in tokenizer.all_special_tokens if t != "<|im_end|>")
    for fake in fakes:
        fake.reply_text = f"Hi{special} there"
    client = _client(frontend)
    plain = client.completions.create(model="tiny", prompt="Hi", max_tokens=20)
    kept = client.completions.create(model="tiny", prompt="Hi", max_tokens=20,
                                     extra_body={"skip_special_tokens": False})
    assert special not in plain.choices[0].text and special in kept.choices[0].text


def test_stream_options_beyond_include_usage_are_refused_unless_neutral(env):
    frontend, _, _ = env
    body = {"model": "tiny", "max_tokens": 3, "prompt": "Hi", "stream": True}
    url, headers = f"{frontend.base_url}/v1/completions", frontend.headers()
    refused = httpx.post(url, headers=headers, timeout=20,
                         json={**body, "stream_options": {"continuous_usage_stats": True}})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    neutral = httpx.post(url, headers=headers, timeout=20,
                         json={**body, "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert neutral.status_code == 200 and '"usage"' in neutral.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_are_a_400(env, path):
    """OpenAI: "only set this when you set stream: true" (vLLM answers 400 too): usage asked for
    there would otherwise be silently absent from a body that always carries it anyway."""
    frontend, _, _ = env
    base = {"prompt": "Hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(f"{frontend.base_url}{path}", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "max_tokens": 3, **base, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "Hi", "foo": 1}]}, "messages[0].foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "foo": 1}]}]},
     "messages[0].content[0].foo"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{**CALL, "x": 1}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages[1].tool_calls[0].x"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {**CALL["function"], "x": 1}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
     "messages[1].tool_calls[0].function.x"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "x": 1}}], "tool_choice": "none"}, "tools[0].function.x"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}},
     "tool_choice.function.x"),
    ({"metadata": "not an object"}, "metadata"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Yes.", "reasoning_content": "think"},
                   {"role": "user", "content": "Go on"}]}, "messages[1].reasoning_content"),
])
def test_a_field_inside_a_message_tool_or_tool_choice_is_read_or_refused_by_name(env, body, param):
    """Nested fields the server would drop on the way to the template: each a 400 naming it (the
    test model's template never shows an earlier turn's thinking)."""
    frontend, _, _ = env
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    echoed = {"role": "assistant", "content": "Yes.", "refusal": None, "annotations": []}  # as the client returns it
    r = httpx.post(f"{frontend.base_url}/v1/chat/completions", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "max_tokens": 3, "messages": [
                       {"role": "user", "content": "Hi"}, echoed, {"role": "user", "content": "More"}]})
    assert r.status_code == 200, r.text


def test_text_offsets_stay_inside_the_text_when_it_skips_special_tokens(env):
    frontend, fakes, tokenizer = env
    special = next(t for t in tokenizer.all_special_tokens if t != "<|im_end|>")
    for fake in fakes:
        fake.reply_text = f"Hi{special} there"
    choice = _client(frontend).completions.create(model="tiny", prompt="Hi", max_tokens=20, logprobs=0).choices[0]
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert special in tokens and special not in choice.text
    for token, offset in zip(tokens, offsets):
        assert token == special or choice.text[offset:offset + len(token)] == token, (tokens, offsets, choice.text)
