"""--reasoning-parser over HTTP with the official openai client: a real frontend process whose
fake scheduler replies with scripted text (the parsers themselves: unit/test_frontend_reasoning.py)."""

from __future__ import annotations

import json

import openai
import pytest

from support.frontend_harness import API_KEY

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "<think>\nTwo and two, 東京 🙂.\n</think>\n\nIt is 4."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}


def _client(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=20)


def _streamed(stream) -> tuple[str, str, list[dict], str]:
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                calls.append({"name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_content_is_the_same_streamed_or_not(thinking_env):
    frontend, fake, _ = thinking_env
    fake.reply_text = THOUGHT
    client = _client(frontend)
    message = client.chat.completions.create(model="tiny", messages=USER).choices[0].message
    assert (message.reasoning_content, message.content) == ("\nTwo and two, 東京 🙂.\n", "\n\nIt is 4.")
    streamed = _streamed(client.chat.completions.create(model="tiny", messages=USER, stream=True))
    assert streamed == (message.reasoning_content, message.content, [], "stop")


def test_tool_calls_come_from_the_content_after_the_thinking(thinking_env):
    frontend, fake, _ = thinking_env
    fake.reply_text = ('<think>Maybe <tool_call> the weather tool.</think>\n<tool_call>\n'
                       '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    client = _client(frontend)
    choice = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER]).choices[0]
    assert choice.message.reasoning_content == "Maybe <tool_call> the weather tool."
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"} and choice.finish_reason == "tool_calls"
    reasoning, _, calls, finish = _streamed(client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], stream=True))
    assert (reasoning, calls, finish) == (choice.message.reasoning_content,
                                          [{"name": "get_weather", "arguments": call.function.arguments}],
                                          "tool_calls")


def test_enable_thinking_false_reaches_the_template_and_the_output_is_all_content(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = "Just 4."
    client = _client(frontend)
    message = client.chat.completions.create(model="tiny", messages=USER, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None)) == ("Just 4.", None)
    assert tokenizer.decode(fake.added[-1].prompt_token_ids).endswith("assistant\n<think>\n\n</think>\n\n")


def test_structured_output_while_thinking_is_a_400_naming_the_field_and_fine_without_thinking(thinking_env):
    frontend, fake, _ = thinking_env
    client = _client(frontend)
    with pytest.raises(openai.BadRequestError, match="response_format.*enable_thinking") as refused:
        client.chat.completions.create(model="tiny", messages=USER, response_format=SCHEMA_FORMAT)
    assert refused.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required")
    fake.reply_text = "{}"
    sent = len(fake.added)
    reply = client.chat.completions.create(model="tiny", messages=USER, response_format=SCHEMA_FORMAT,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == "{}" and len(fake.added) == sent + 1
    assert json.loads(fake.added[-1].sampling.structured_outputs.json) == {"type": "object"}
