"""/v1/messages and /v1/messages/count_tokens with the official anthropic client: a real
frontend process (--reasoning-parser qwen3, hermes tool calls) whose fake scheduler replies with
scripted text. The real engine behind the same surface: e2e/test_e2e_api_surfaces.py."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from support.frontend_harness import API_KEY

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "Weather in Oslo?"}]
NO_THINKING = {"type": "disabled"}
WEATHER = {"name": "get_weather", "description": "The weather now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ('<think>The tool knows.</think>\nLet me look.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def _client(frontend) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=frontend.base_url, api_key=API_KEY, max_retries=0, timeout=20)


def _blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None) or (b.name, b.input))
            for b in message.content]


def test_a_plain_message_and_its_stream_agree(thinking_env):
    frontend, fake, _ = thinking_env
    fake.reply_text = "<think>Short thought.</think>Sunny, 東京 🙂."
    client = _client(frontend)
    message = client.messages.create(model="tiny", max_tokens=64, system="Be brief.", messages=USER)
    assert _blocks(message) == [("thinking", "Short thought."), ("text", "Sunny, 東京 🙂.")]
    assert (message.role, message.stop_reason, message.stop_sequence) == ("assistant", "end_turn", None)
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert "Be brief." in fake.tokenizer.decode(fake.added[-1].prompt_token_ids)
    with client.messages.stream(model="tiny", max_tokens=64, system="Be brief.", messages=USER) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(message) and final.stop_reason == "end_turn"
    events = [e.type for e in client.messages.create(model="tiny", max_tokens=64, messages=USER, stream=True)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 2


def test_a_tool_call_is_a_tool_use_block_streamed_or_not(thinking_env):
    frontend, fake, _ = thinking_env
    fake.reply_text = CALL
    client = _client(frontend)
    message = client.messages.create(model="tiny", max_tokens=64, messages=USER, tools=[WEATHER])
    assert _blocks(message) == [("thinking", "The tool knows."), ("text", "\nLet me look.\n"),
                                ("tool_use", ("get_weather", {"city": "Oslo"}))]
    assert message.stop_reason == "tool_use" and message.content[2].id
    with client.messages.stream(model="tiny", max_tokens=64, messages=USER, tools=[WEATHER]) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(message) and final.stop_reason == "tool_use"


def test_tool_results_and_earlier_tool_uses_reach_the_prompt(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = "It is sunny."
    client = _client(frontend)
    messages = [*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sun"}]}]
    message = client.messages.create(model="tiny", max_tokens=64, messages=messages, tools=[WEATHER],
                                      thinking=NO_THINKING)
    assert _blocks(message) == [("text", "It is sunny.")]
    prompt = tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert '"name": "get_weather", "arguments": {"city": "Oslo"}' in prompt
    assert "<tool_response>\n18 C, sun\n</tool_response>" in prompt
    counted = client.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER], thinking=NO_THINKING)
    assert counted.input_tokens == len(fake.added[-1].prompt_token_ids)


def test_a_prefill_is_continued_and_the_reply_holds_only_the_continuation(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = " sunny and 18 C."
    client = _client(frontend)
    prefill = [*USER, {"role": "assistant", "content": "In Oslo it is"}]
    message = client.messages.create(model="tiny", max_tokens=64, messages=prefill, thinking=NO_THINKING,
                                     metadata={"user_id": "team-a"})
    assert _blocks(message) == [("text", " sunny and 18 C.")]
    added = fake.added[-1]
    assert tokenizer.decode(added.prompt_token_ids).endswith("assistant\nIn Oslo it is")
    assert added.tenant == "team-a"  # metadata.user_id, as chat's user
    with client.messages.stream(model="tiny", max_tokens=64, messages=prefill, thinking=NO_THINKING) as stream:
        assert _blocks(stream.get_final_message()) == _blocks(message)
    counted = client.messages.count_tokens(model="tiny", messages=prefill, thinking=NO_THINKING)
    assert counted.input_tokens == len(added.prompt_token_ids)


def test_a_reply_with_thinking_and_a_tool_use_can_be_sent_back_as_it_came(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = CALL
    client = _client(frontend)
    first = client.messages.create(model="tiny", max_tokens=64, messages=USER, tools=[WEATHER])
    fake.reply_text = "<think>Sunny.</think>It is sunny."
    messages = [*USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": first.content[2].id, "content": "18 C, sun"}]}]
    message = client.messages.create(model="tiny", max_tokens=64, messages=messages, tools=[WEATHER])
    assert _blocks(message) == [("thinking", "Sunny."), ("text", "It is sunny.")]
    assert "<think>\nThe tool knows.\n</think>" in tokenizer.decode(fake.added[-1].prompt_token_ids)


def test_stop_sequences_end_the_text_and_are_named(thinking_env):
    frontend, fake, _ = thinking_env
    client = _client(frontend)
    message = client.messages.create(model="tiny", max_tokens=64, messages=USER, stop_sequences=["How"],
                                     thinking=NO_THINKING,  # this client sends sampling fields as extras
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert _blocks(message) == [("text", "Hello, world! ")]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "How")
    sampling = fake.added[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 5)


@pytest.mark.parametrize("body,named", [
    ({"max_tokens": 8, "messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}]}]},
     "citations"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 8, "messages": USER, "temperature": 1.5}, "temperature")])
def test_unknown_or_unserved_fields_are_a_400_in_anthropics_error_shape(thinking_env, body, named):
    frontend, _, _ = thinking_env
    r = httpx.post(f"{frontend.base_url}/v1/messages", headers={"x-api-key": API_KEY}, timeout=20,
                   json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert named in r.json()["error"]["message"]


def test_an_engine_refusal_and_a_wrong_key_keep_anthropics_shape(thinking_env):
    frontend, fake, _ = thinking_env
    fake.mode = "reject"
    with pytest.raises(anthropic.BadRequestError, match="KV blocks"):
        _client(frontend).messages.create(model="tiny", max_tokens=8, messages=USER, stream=True)
    r = httpx.post(f"{frontend.base_url}/v1/messages", headers={"x-api-key": "wrong"}, timeout=20,
                   json={"model": "tiny", "max_tokens": 8, "messages": USER})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
