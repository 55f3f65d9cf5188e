"""Tool calls over HTTP with the official openai client: a real frontend process whose fake
scheduler replies with scripted text (the grammar itself is tested with the real engine in
test_e2e_tool_calls.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from support.frontend_harness import API_KEY, fake_deployment

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
HERMES_REPLY = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_factory):
    with fake_deployment(tmp_path_factory, model_factory("qwen2"), 1, 512, extra_args=[
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as (frontend, (fake,), _):
        yield openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key=API_KEY, max_retries=0,
                            timeout=20), fake


def _streamed_calls(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                assert call.id.startswith("call_") and call.type == "function"
                calls.append({"name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_auto_tool_choice_parses_hermes_calls_the_same_streamed_or_not(server):
    client, fake = server
    fake.reply_text = HERMES_REPLY
    full = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)
    content, streamed, finish = _streamed_calls(client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], stream=True))
    assert (content, streamed, finish) == ("Checking.\n", calls, "tool_calls")
    prompt = fake.tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert json.dumps(WEATHER) in prompt  # the template was shown the tools


def test_plain_text_passes_through_auto_tool_choice_untouched(server):
    client, fake = server
    fake.reply_text = "No tools needed <tool but not a call."
    full = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert full.choices[0].message.content == fake.reply_text and not full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "stop"


def test_required_sends_the_call_schema_to_the_engine_and_returns_its_calls(server):
    client, fake = server
    fake.reply_text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    full = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                          tool_choice="required")
    schema = json.loads(fake.added[-1].sampling.structured_outputs.json)
    assert schema["items"]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    (call,) = full.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert full.choices[0].message.content is None and full.choices[0].finish_reason == "tool_calls"


def test_an_unknown_named_function_and_conflicting_template_flags_are_400s(server):
    client, _fake = server
    with pytest.raises(openai.BadRequestError, match="get_news"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_news"}})
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="tiny", messages=USER,
                                       extra_body={"continue_final_message": True})


def test_template_options_change_the_prompt_sent_to_the_engine(server):
    client, fake = server
    fake.reply_text = "ok"
    messages = [*USER, {"role": "assistant", "content": "Paris is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    client.chat.completions.create(model="tiny", messages=messages, extra_body=options)
    sent = fake.added[-1].prompt_token_ids
    assert fake.tokenizer.decode(sent).endswith("<|im_start|>assistant\nParis is")
    tokenized = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"), headers={
        "Authorization": f"Bearer {API_KEY}"}, json={"messages": messages, **options}).json()
    assert tokenized["tokens"] == sent  # /tokenize renders the same options the same way


def test_a_stop_string_that_cuts_a_forced_call_ends_with_stop_not_tool_calls(server):
    """A client's stop string inside the arguments leaves them unclosed: "tool_calls" would tell
    the client to run a call it cannot parse; the choice ends "stop", as max_tokens ends "length"."""
    client, fake = server
    fake.reply_text = '{"city": "Paris"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=named,
                                          stop=["Par"])
    (call,) = full.choices[0].message.tool_calls
    assert call.function.arguments == '{"city": "' and full.choices[0].finish_reason == "stop"
    _, streamed, finish = _streamed_calls(client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], tool_choice=named, stop=["Par"], stream=True))
    assert streamed == [{"name": "get_weather", "arguments": '{"city": "'}] and finish == "stop"
    whole = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=named)
    assert whole.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("reply", [
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # invalid arguments
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> and then <tool_',  # junk after
])
def test_a_malformed_auto_call_streams_as_the_full_response_has_it(server, reply):
    """Without a grammar only the whole output says whether its calls are well formed (else all of
    it is content, vLLM's rule): a stream never announces a call the full response does not hold."""
    client, fake = server
    fake.reply_text = reply
    full = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    choice = full.choices[0]
    want = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
    streamed = _streamed_calls(client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                                              stream=True))
    assert streamed == ((choice.message.content or ""), want, choice.finish_reason)
