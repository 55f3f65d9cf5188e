"""The Responses and Anthropic surfaces on a real deployment (the shared server, demo model):
at temperature 0 they answer what chat answers for the same conversation, streamed or not, and a
grammar (json_schema format, a forced tool) makes even a random model's output valid."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from support.greedy import client as openai_client
from support.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
QUESTION = "Weather in Paris for three days?"
GREEDY = {"temperature": 0}  # anthropic 2.x's client takes sampling fields only as extras


@pytest.fixture(scope="module")
def clients(shared_server):
    openai = openai_client(shared_server)
    model = openai.models.list().data[0].id
    claude = anthropic.Anthropic(base_url=shared_server.url, api_key="unused", max_retries=0, timeout=120)
    return openai, claude, model


def _chat_text(openai, model: str, max_tokens: int) -> str:
    reply = openai.chat.completions.create(model=model, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def test_responses_answer_what_chat_answers_streamed_or_not(clients):
    openai, _, model = clients
    expected = _chat_text(openai, model, 12)
    response = openai.responses.create(model=model, instructions="Be brief.", input=QUESTION,
                                       max_output_tokens=12, temperature=0)
    assert response.output_text == expected and response.usage.output_tokens <= 12
    assert response.status in ("completed", "incomplete")
    deltas, final = [], None
    for event in openai.responses.create(model=model, instructions="Be brief.", input=QUESTION,
                                         max_output_tokens=12, temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = event.response if event.type in ("response.completed", "response.incomplete") else final
    assert "".join(deltas) == expected == final.output_text and final.status == response.status


def test_responses_json_schema_format_and_forced_function_call_follow_their_schemas(clients):
    openai, _, model = clients
    response = openai.responses.create(model=model, input="A person, please.", max_output_tokens=200,
                                       text={"format": {"type": "json_schema", "name": "person",
                                                        "schema": SCHEMAS["person"], "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMAS["person"])
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    response = openai.responses.create(model=model, input=QUESTION, tools=[tool], max_output_tokens=60,
                                       tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)


def test_anthropic_messages_answer_what_chat_answers_streamed_or_not_and_a_forced_tool_is_valid(clients):
    openai, claude, model = clients
    expected = _chat_text(openai, model, 12)
    message = claude.messages.create(model=model, system="Be brief.", max_tokens=12, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}])
    assert "".join(b.text for b in message.content) == expected
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 12
    with claude.messages.stream(model=model, system="Be brief.", max_tokens=12, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        assert "".join(stream.text_stream) == expected
    tool = {"name": "get_weather", "input_schema": PARAMETERS}
    message = claude.messages.create(model=model, max_tokens=60, tools=[tool],
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": QUESTION}])
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(use.input, PARAMETERS)
