"""The Responses and Anthropic requests as the chat requests they translate into, and a chat
payload rendered back in each surface's shape (in process; the surfaces over HTTP are in
e2e/test_frontend_responses_api.py and e2e/test_frontend_anthropic.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagedserve.frontend_proc.anthropic_messages import full_message
from pagedserve.frontend_proc.anthropic_schema import MessagesRequest
from pagedserve.frontend_proc.errors import InvalidRequest, in_surface_terms
from pagedserve.frontend_proc.responses_api import CHAT_FIELDS, ResponseBuilder, full_response
from pagedserve.frontend_proc.responses_schema import ResponsesRequest

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}


def _roles(chat) -> list[tuple]:
    return [(m.role, m.content, [c.function.name for c in m.tool_calls or []], m.tool_call_id)
            for m in chat.messages]


def test_anthropic_system_tool_uses_and_results_become_chat_messages_in_order():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief.", "cache_control": {}}],
        "stop_sequences": ["\n\n"], "top_k": 3, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking."}, TOOL_USE]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"},
                                         {"type": "text", "text": "And tomorrow?"}]}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    chat = body.chat()
    assert _roles(chat) == [("system", "Be brief.", [], None), ("user", "Weather?", [], None),
                            ("assistant", "Looking.", ["get_weather"], None), ("tool", "sun", [], "toolu_1"),
                            ("user", "And tomorrow?", [], None)]
    assert json.loads(chat.messages[2].tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.tool_choice, chat.parallel_tool_calls) == (
        9, ["\n\n"], 3, "required", False)
    assert chat.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize("extra,named", [({"container": "c"}, "container"), ({"thinking": {"type": "enabled",
                                         "budget_tokens": 1024}}, "thinking")])
def test_anthropic_fields_not_served_are_refused_by_name(extra, named):
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": [
        {"role": "user", "content": "hi"}], **extra})
    with pytest.raises(InvalidRequest, match=named):
        body.chat()
    with pytest.raises(ValidationError):  # an image block is not a block this server reads
        MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]})


CHAT_PAYLOAD = {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None,
                "message": {"role": "assistant", "content": "Let me see.", "reasoning_content": "Hm.",
                            "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


def test_a_chat_payload_as_an_anthropic_message():
    message = full_message(CHAT_PAYLOAD, "m")
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2] == {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                     "input": {"city": "Oslo"}}
    assert (message["stop_reason"], message["usage"]) == ("tool_use", {"input_tokens": 5, "output_tokens": 7})


def test_responses_items_become_chat_messages_and_the_payload_becomes_output_items():
    body = ResponsesRequest.model_validate({"model": "m", "instructions": "Be brief.", "max_output_tokens": 20,
                                            "input": [{"role": "developer", "content": "Use tools."},
                                                      {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                                                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                                      {"type": "function_call_output", "call_id": "c1", "output": "sun"}],
                                            "text": {"format": {"type": "json_object"}}})
    chat = body.chat()
    assert _roles(chat) == [("system", "Be brief.", [], None), ("system", "Use tools.", [], None),
                            ("user", "Weather?", [], None), ("assistant", None, ["f"], None), ("tool", "sun", [], "c1")]
    assert (chat.max_tokens, chat.response_format.type) == (20, "json_object")
    response = full_response(ResponseBuilder(body, "m"), CHAT_PAYLOAD)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2]["call_id"] == "call_1" and response["status"] == "completed"
    assert response["usage"]["total_tokens"] == 12 and response["text"] == {"format": {"type": "json_object"}}


def test_a_refusal_of_the_translated_request_names_the_field_the_client_sent():
    refused = in_surface_terms(InvalidRequest("response_format: cannot", param="response_format"), CHAT_FIELDS)
    assert (refused.param, refused.message) == ("text.format", "text.format: cannot")
    with pytest.raises(InvalidRequest, match="store"):
        ResponsesRequest.model_validate({"input": "hi", "store": True}).chat()
