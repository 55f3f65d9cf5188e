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


def test_structured_output_while_thinking_starts_after_the_end_token_and_from_the_start_without(thinking_env):
    frontend, fake, tokenizer = thinking_env
    client = _client(frontend)
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    fake.reply_text = "<think>free {text</think>{}"
    reply = client.chat.completions.create(model="tiny", messages=USER, response_format=SCHEMA_FORMAT)
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("free {text", "{}")
    spec = fake.added[-1].sampling.structured_outputs
    assert json.loads(spec.json) == {"type": "object"} and spec.start_after == [end_id]
    client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required")
    assert fake.added[-1].sampling.structured_outputs.start_after == [end_id]
    fake.reply_text = "{}"
    reply = client.chat.completions.create(model="tiny", messages=USER, response_format=SCHEMA_FORMAT,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == "{}"
    spec = fake.added[-1].sampling.structured_outputs
    assert json.loads(spec.json) == {"type": "object"} and spec.start_after == []


def test_reasoning_tokens_are_the_tokens_through_the_end_tag_streamed_or_not(thinking_env):
    frontend, fake, tokenizer = thinking_env
    client = _client(frontend)
    fake.reply_text = THOUGHT
    thinking = len(tokenizer.encode(THOUGHT[:THOUGHT.index("</think>") + len("</think>")]))
    answer = len(tokenizer.encode(THOUGHT)) - thinking
    assert thinking > 5 and answer > 2
    usage = client.chat.completions.create(model="tiny", messages=USER).usage
    assert usage.completion_tokens_details.reasoning_tokens == thinking
    assert usage.completion_tokens == thinking + answer + 1  # and the end-of-sequence token
    two = client.chat.completions.create(model="tiny", messages=USER, n=2).usage
    assert two.completion_tokens_details.reasoning_tokens == 2 * thinking  # summed over the choices
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking
    response = client.responses.create(model="tiny", input="What is 2 + 2?")
    assert response.usage.output_tokens_details.reasoning_tokens == thinking
    fake.reply_text = "Just 4."  # the thinking switched off: nothing to count, no details
    usage = client.chat.completions.create(model="tiny", messages=USER, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).usage
    assert usage.completion_tokens_details is None


def test_a_continued_final_message_is_content_unless_it_left_a_thinking_open(thinking_env):
    """A prefill ends the prompt with its own text: what follows "The answer is" is the answer,
    and only a prefill that opened a <think> and did not close it continues the thinking."""
    frontend, fake, _ = thinking_env
    fake.reply_text = " 4, plainly."
    client = _client(frontend)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    answer = client.chat.completions.create(model="tiny", extra_body=continued, messages=[
        *USER, {"role": "assistant", "content": "The answer is"}]).choices[0].message
    assert (answer.content, getattr(answer, "reasoning_content", None)) == (" 4, plainly.", None)
    fake.reply_text = " sums.</think>\n\nIt is 4."
    thought = client.chat.completions.create(model="tiny", extra_body=continued, messages=[
        *USER, {"role": "assistant", "content": "<think>\nSmall"}]).choices[0].message
    assert (thought.reasoning_content, thought.content) == (" sums.", "\n\nIt is 4.")
