"""Forced tool choices on a real deployment: the grammar makes even a random model's output a
valid call of the tool, and the streamed deltas add up to the same call (openai client)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from support.greedy import client as openai_client

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
USER = [{"role": "user", "content": "Weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def client(shared_server):
    """On the shared server: its cache holds the ~800-token prompt with both tools and 300 answer tokens."""
    return openai_client(shared_server)


def _streamed_calls(stream) -> tuple[list[dict], str]:
    calls, finish = [], None
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index == len(calls):
                calls.append({"name": delta.function.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return calls, finish


@pytest.mark.parametrize("tool_choice, extra", [
    ({"type": "function", "function": {"name": "get_weather"}}, {}),
    ("required", {"parallel_tool_calls": False}),
])
def test_forced_tool_choice_returns_a_valid_call_streamed_or_not(client, tool_choice, extra):
    request = dict(model=client.models.list().data[0].id, messages=USER, tools=[WEATHER, CLOCK],
                   tool_choice=tool_choice, temperature=0, max_tokens=300, **extra)
    full = client.chat.completions.create(**request)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert len(calls) == 1 and all(c.id.startswith("call_") for c in choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    streamed, finish = _streamed_calls(client.chat.completions.create(**request, stream=True))
    assert (streamed, finish) == (calls, "tool_calls")  # greedy: the same output, cut into deltas
