"""/v1/responses requests as the chat requests and prompts they become, and the refusals a
client reads, in process: reasoning items sent back, Responses' own stream_options, and the
exemptions for echoed items kept inside the items (the surface over HTTP:
e2e/test_frontend_responses_api.py)."""

from __future__ import annotations

import pytest

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.chat_request import prepare_chat
from pagedserve.frontend_proc.errors import InvalidRequest, in_surface_terms
from pagedserve.frontend_proc.reasoning import REASONING_PARSERS
from pagedserve.frontend_proc.response_format import ChatFormat
from pagedserve.frontend_proc.responses_api import CHAT_FIELDS, ResponseBuilder, full_response
from pagedserve.frontend_proc.responses_schema import MESSAGE_PARTS, ResponsesRequest
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig
from pagedserve.tools.demo_model import CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE, build_tokenizer

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
USER = {"role": "user", "content": "Weather in Oslo?"}
CALLED = {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None,
          "message": {"role": "assistant", "content": "Let me see.", "reasoning_content": "Use the tool.",
                      "tool_calls": [{"id": "call_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}


def _tokenizer(tmp_path_factory, template: str) -> PromptTokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(512, template, think_tokens=True).save_pretrained(path)
    return PromptTokenizer(path)


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory) -> PromptTokenizer:
    return _tokenizer(tmp_path_factory, THINKING_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory) -> PromptTokenizer:
    return _tokenizer(tmp_path_factory, CHAT_TEMPLATE)


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def _sent_back(**fields) -> ResponsesRequest:
    """A tool loop's second request: the first response's output items, as this server wrote them."""
    first = full_response(ResponseBuilder(_request(input=[USER], tools=[WEATHER]), "m"), CALLED)
    assert [item["type"] for item in first["output"]] == ["reasoning", "message", "function_call"]
    return _request(input=[USER, *first["output"], RESULT], tools=[WEATHER], **fields)


def _prompt(tokenizer: PromptTokenizer, body: ResponsesRequest) -> str:
    """The prompt /v1/responses would send, or its refusal in the client's terms (as the route)."""
    try:
        chat = prepare_chat(body.chat(), tokenizer, ToolCallingConfig(True, "hermes"), ChatFormat("m"),
                            REASONING_PARSERS["qwen3"])
    except InvalidRequest as exc:
        raise in_surface_terms(exc, CHAT_FIELDS, body.origins(), MESSAGE_PARTS) from None
    return tokenizer.tokenizer.decode(chat.prompt_ids)


def test_a_reasoning_item_sent_back_is_the_thinking_of_the_assistant_turn_it_opens(thinking_tokenizer):
    chat = _sent_back().chat()
    assert [(m.role, m.content, m.reasoning_content, len(m.tool_calls or [])) for m in chat.messages] == [
        ("user", "Weather in Oslo?", None, 0), ("assistant", "Let me see.", "Use the tool.", 1),
        ("tool", "18 C", None, 0)]
    turn = _prompt(thinking_tokenizer, _sent_back()).split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn.startswith("<think>\nUse the tool.\n</think>\n\n"), turn
    assert turn.index("Let me see.") < turn.index('{"name": "get_weather", "arguments": {"city": "Oslo"}}')


def test_a_reasoning_item_with_only_a_summary_or_before_calls_alone_keeps_its_turn():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [
        {"type": "summary_text", "text": "Check."}, {"type": "summary_text", "text": "Call."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    chat = _request(input=[USER, reasoning, call, RESULT]).chat()
    assert [(m.role, m.content, m.reasoning_content, len(m.tool_calls or [])) for m in chat.messages] == [
        ("user", "Weather in Oslo?", None, 0), ("assistant", None, "Check.\n\nCall.", 1), ("tool", "18 C", None, 0)]


def test_thinking_a_template_never_shows_is_a_400_naming_the_reasoning_item(plain_tokenizer):
    with pytest.raises(InvalidRequest) as refused:
        _prompt(plain_tokenizer, _sent_back(instructions="Be brief."))  # chat's messages[2]
    assert refused.value.param == "input[1]" and refused.value.message.startswith("input[1]: the chat template")


@pytest.mark.parametrize("reasoning,param", [
    ({"encrypted_content": "gAAAA", "content": [{"type": "reasoning_text", "text": "x"}]},
     "input[1].encrypted_content"),
    ({}, "input[1]"),  # nothing to show: OpenAI would look it up by id in its store
    ({"content": [{"type": "reasoning_text", "text": "x", "signature": "s"}]}, "input[1].content[0].signature")])
def test_reasoning_this_server_cannot_show_is_a_400_naming_it(reasoning, param):
    body = _request(input=[USER, {"type": "reasoning", "id": "rs_1", "summary": [], **reasoning}])
    with pytest.raises(InvalidRequest) as refused:
        body.chat()
    assert refused.value.param == param, refused.value.message
    _request(input=[USER, {"type": "reasoning", "summary": [], "encrypted_content": None,
                           "content": [{"type": "reasoning_text", "text": "x"}]}]).chat()  # null: omitted


@pytest.mark.parametrize("fields,param,reason", [
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage", "usage"),
    ({"stream": True, "stream_options": {"include_usage": False}}, "stream_options.include_usage", "usage"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "no obfuscation padding"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream: true"),
    ({"stream": False, "stream_options": {}}, "stream_options", "stream: true")])
def test_stream_options_are_responses_own_and_only_with_stream(fields, param, reason):
    with pytest.raises(InvalidRequest, match=reason) as refused:
        _request(input="hi", **fields).chat()
    assert refused.value.param == param


def test_stream_options_that_change_nothing_are_served_with_stream():
    for options in ({}, {"include_obfuscation": False}, None):
        assert _request(input="hi", stream=True, stream_options=options).chat().stream


@pytest.mark.parametrize("name,value", [("logprobs", 5), ("status", "x"), ("id", "x"), ("annotations", 1)])
def test_fields_of_echoed_items_are_refused_at_the_top_level(name, value):
    with pytest.raises(InvalidRequest, match=f"^{name} is not supported") as refused:
        _request(input="hi", **{name: value}).chat()
    assert refused.value.param == name
    if name == "logprobs":  # as top_logprobs is
        assert "use /v1/chat/completions" in refused.value.message


def test_fields_of_echoed_items_are_accepted_in_items_and_their_parts_only():
    message = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [
        {"type": "output_text", "text": "Hi.", "annotations": [], "logprobs": []}]}
    assert _request(input=[USER, message]).chat().messages[-1].content == "Hi."
    for misplaced, param in (({"user": "u"}, "input[1].user"), ({"store": False}, "input[1].store")):
        with pytest.raises(InvalidRequest) as refused:
            _request(input=[USER, {**message, **misplaced}]).chat()
        assert refused.value.param == param
    _request(input="hi", text={"verbosity": "medium"}, user="u", store=False).chat()
