"""/v1/responses with the official openai client: a real frontend process (--reasoning-parser
qwen3, hermes tool calls) whose fake scheduler replies with scripted text; then OpenAI's
published schema for /responses fuzzed by schemathesis. The real engine behind the same surface:
e2e/test_e2e_api_surfaces.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.frontend_proc.responses_schema import ABOUT_THE_CALLER, ResponsesRequest

from support.frontend_harness import API_KEY
from support.openai_stream_schema import pin_model, stream_validator, stream_violations

pytestmark = pytest.mark.slow
SCHEMA_DOC = Path(__file__).resolve().parents[3] / "shared" / "openai-openapi" / "openai_responses_embeddings.json"
NO_THINKING = {"effort": "none"}  # reasoning.effort: Qwen3's enable_thinking false
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ('<think>Use the tool.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>')


def _client(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=20)


def _items(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.name, item.arguments, item.call_id))
    return out


def _from_events(events) -> tuple[list[str], object]:
    kinds, final = [], None
    for event in events:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return kinds, final


def test_plain_input_and_instructions_give_a_message_and_the_stream_adds_up_to_it(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = "<think>Brief.</think>Hi, 東京 🙂!"
    client = _client(frontend)
    response = client.responses.create(model="tiny", input="Say hi", instructions="Be brief.",
                                       max_output_tokens=32, temperature=0.5, top_p=0.9)
    assert response.status == "completed" and response.output_text == "Hi, 東京 🙂!"
    assert _items(response) == [("reasoning", "Brief."), ("message", "Hi, 東京 🙂!")]
    assert response.usage.input_tokens == len(fake.added[-1].prompt_token_ids) and response.usage.output_tokens > 0
    prompt = tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert prompt.index("Be brief.") < prompt.index("Say hi")
    sampling = fake.added[-1].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (32, 0.5, 0.9)
    kinds, final = _from_events(client.responses.create(model="tiny", input="Say hi", instructions="Be brief.",
                                                        stream=True))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert "response.output_text.delta" in kinds and "response.reasoning_text.delta" in kinds
    assert _items(final) == _items(response) and final.output_text == response.output_text


def test_a_function_call_streamed_or_not_and_its_output_sent_back(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = CALL
    client = _client(frontend)
    response = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER])
    (reasoning, text, call) = _items(response)  # the text before the call is a message, as in chat
    assert (reasoning, text) == (("reasoning", "Use the tool."), ("message", "\n"))
    assert call[:2] == ("function_call", "get_weather") and json.loads(call[2]) == {"city": "Oslo"}
    kinds, final = _from_events(client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER],
                                                        stream=True))
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [i[:3] for i in _items(final)] == [i[:3] for i in _items(response)]
    fake.reply_text = "Sunny."
    follow_up = client.responses.create(model="tiny", tools=[WEATHER], reasoning=NO_THINKING, input=[
        {"role": "user", "content": "Weather in Oslo?"}, *response.output,  # the items as they came
        {"type": "function_call_output", "call_id": call[3], "output": "18 C"}])
    assert follow_up.output_text == "Sunny."
    prompt = tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert "<tool_response>\n18 C\n</tool_response>" in prompt
    assert prompt.index("<think>\nUse the tool.\n</think>") < prompt.index('"arguments": {"city": "Oslo"}')


def test_a_json_schema_format_is_sent_to_the_engine_as_its_grammar_after_any_thinking(thinking_env):
    frontend, fake, tokenizer = thinking_env
    fake.reply_text = '{"city": "Oslo"}'
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    response = _client(frontend).responses.create(
        model="tiny", input="JSON please", reasoning=NO_THINKING,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"city": "Oslo"}
    assert json.loads(fake.added[-1].sampling.structured_outputs.json) == schema
    assert response.text.format.type == "json_schema"
    assert fake.added[-1].sampling.structured_outputs.start_after == []  # no thinking: from the first token
    fake.reply_text = '<think>Oslo, surely.</think>{"city": "Oslo"}'
    response = _client(frontend).responses.create(
        model="tiny", input="JSON please",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"city": "Oslo"}
    assert fake.added[-1].sampling.structured_outputs.start_after == [tokenizer.convert_tokens_to_ids("</think>")]
    assert [item.type for item in response.output] == ["reasoning", "message"]


@pytest.mark.parametrize("body,param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"), ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"), ({"logprobs": 5}, "logprobs"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}]},
     "input[0].encrypted_content")])
def test_unserved_fields_are_a_400_naming_them(thinking_env, body, param):
    frontend, _, _ = thinking_env
    r = httpx.post(f"{frontend.base_url}/v1/responses", headers=frontend.headers(), timeout=20,
                   json={"model": "tiny", "input": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _request_fields(schemas: dict, name: str) -> set[str]:
    node = schemas[name]
    names = set(node.get("properties", {}))
    for part in node.get("allOf", []):
        ref = part.get("$ref")
        names |= _request_fields(schemas, ref.rsplit("/", 1)[-1]) if ref else set(part.get("properties", {}))
    return names


def test_every_published_request_field_is_declared_about_the_caller_or_refused_by_name(thinking_env):
    if not SCHEMA_DOC.is_file():
        pytest.skip(f"OpenAI's schema is not at {SCHEMA_DOC}")
    frontend, fake, _ = thinking_env
    schemas = json.loads(SCHEMA_DOC.read_text())["components"]["schemas"]
    undeclared = sorted(_request_fields(schemas, "CreateResponse") - set(ResponsesRequest.model_fields))
    assert "store" in undeclared and "previous_response_id" in undeclared  # the schema was read
    for field in undeclared:
        r = httpx.post(f"{frontend.base_url}/v1/responses", headers=frontend.headers(), timeout=20,
                       json={"model": "tiny", "input": "hi", field: "some value"})
        if field in ABOUT_THE_CALLER:
            assert r.status_code == 200, (field, r.text)
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_openai_published_responses_schema_fuzzed_by_schemathesis_gets_no_server_error(thinking_env):
    if not SCHEMA_DOC.is_file():
        pytest.skip(f"OpenAI's schema is not at {SCHEMA_DOC}")
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import response_schema_conformance

    frontend, fake, _ = thinking_env
    fake.reply_text = CALL
    raw = json.loads(SCHEMA_DOC.read_text())
    del raw["paths"]["/embeddings"]  # another helper's endpoint
    pin_model(raw["components"]["schemas"]["CreateModelResponseProperties"], "tiny")
    schema = schemathesis.openapi.from_dict(raw)
    (op,) = [result.ok() for result in schema.get_all_operations()]
    validator = stream_validator(raw, "/responses")
    server_errors, nonconforming, answered = [], [], []
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def call(case):
        case.headers = {**(case.headers or {}), **frontend.headers()}
        response = case.call(base_url=frontend.base_url + "/v1", timeout=60)
        answered.append(response.status_code)
        if response.status_code >= 500:
            server_errors.append((case.body, response.status_code, response.text[:300]))
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            problems = stream_violations(validator, response.content.decode())
            if problems:
                nonconforming.append((case.body, problems[:3]))
            return
        try:
            case.validate_response(response, checks=[response_schema_conformance])
        except Exception as exc:
            nonconforming.append((case.body, str(exc)[:500]))

    call()
    # Generated bodies nearly always carry a field this server refuses; served ones, checked the same way:
    for served in ({"input": "hi"}, {"input": "hi", "stream": True}, {"input": "hi", "tools": [WEATHER]},
                   {"input": "hi", "tools": [WEATHER], "stream": True},
                   {"input": "hi", "reasoning": NO_THINKING, "max_output_tokens": 16}):
        call.hypothesis.inner_test(op.Case(body={"model": "tiny", **served}, media_type="application/json"))
    assert not server_errors, server_errors[:3]
    assert not nonconforming, nonconforming[:3]
    assert answered.count(200) >= 5, answered
