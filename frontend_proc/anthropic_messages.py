"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat path.

A request is translated into a chat request (anthropic_schema.py) and served by
``Serving.start_chat``; its chat payloads are rendered as Anthropic's message, or, streaming, as
Anthropic's events: ``message_start``, then per content block ``content_block_start``,
``content_block_delta`` (``text_delta``, ``input_json_delta``, ``thinking_delta``) and
``content_block_stop``, then ``message_delta`` (stop reason and usage) and ``message_stop``.
Reasoning split off by ``--reasoning-parser`` comes back as ``thinking`` blocks; a prefill (a final
assistant message) is continued, and the reply holds only the continuation. Errors, before
or during a stream, have Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.frontend_proc.embeddings_api import task_refusal
from pagedserve.frontend_proc.anthropic_schema import MESSAGE_PARTS, CountTokensRequest, MessagesRequest
from pagedserve.frontend_proc.errors import APIError, in_surface_terms
from pagedserve.frontend_proc.generation import Generation
from pagedserve.frontend_proc.serving import Serving

PATH_PREFIX = "/v1/messages"
# chat request field -> the Anthropic field it came from, for refusals that name one
CHAT_FIELDS = {"stop": "stop_sequences", "chat_template_kwargs": "thinking"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error_body(exc: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.body()["error"]["message"]}}


def anthropic_error(exc: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(exc), status_code=exc.status_code, headers=exc.headers())


def _stop(finish_reason: Optional[str], stop_reason: Any) -> tuple[Optional[str], Optional[str]]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return ("end_turn", None) if finish_reason is not None else (None, None)


def _usage(usage: dict[str, int]) -> dict[str, int]:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


def _message(chat_id: str, content: list[dict[str, Any]], model: str) -> dict[str, Any]:
    return {"id": chat_id.replace("chatcmpl-", "msg_", 1), "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": None, "stop_sequence": None}


def full_message(payload: dict[str, Any], model: str) -> dict[str, Any]:
    choice = payload["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:  # cut short by max_tokens: Anthropic's input must be an object, so as text
            content.append({"type": "text", "text": call["function"]["arguments"]})
            continue
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": arguments})
    body = _message(payload["id"], content, model)
    body["stop_reason"], body["stop_sequence"] = _stop(choice["finish_reason"], choice.get("stop_reason"))
    body["usage"] = _usage(payload["usage"])
    return body


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """The stream's content blocks: one open at a time, each opened by the first delta of its kind."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Optional[tuple[str, Optional[int]]] = None  # (kind, tool call index)

    def switch(self, kind: str, call: Optional[int], start: dict[str, Any]) -> list[bytes]:
        if self.open == (kind, call):
            return []
        events = self.close()
        self.index += 1
        self.open = (kind, call)
        return events + [_event("content_block_start", {"index": self.index, "content_block": start})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


def _chunk_events(blocks: _Blocks, delta: dict[str, Any]) -> list[bytes]:
    events: list[bytes] = []
    if delta.get("reasoning_content"):
        events += blocks.switch("thinking", None, {"type": "thinking", "thinking": "", "signature": ""})
        events.append(blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
    if delta.get("content"):
        events += blocks.switch("text", None, {"type": "text", "text": ""})
        events.append(blocks.delta({"type": "text_delta", "text": delta["content"]}))
    for call in delta.get("tool_calls") or []:
        if "id" in call:
            events += blocks.switch("tool_use", call["index"], {
                "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
        arguments = call["function"].get("arguments")
        if arguments:
            events.append(blocks.delta({"type": "input_json_delta", "partial_json": arguments}))
    return events


async def stream_events(generation: Generation, model: str) -> AsyncIterator[bytes]:
    blocks = _Blocks()
    stop: tuple[Optional[str], Optional[str]] = (None, None)
    output_tokens = 0
    message = _message(generation.fmt.id, [], model)
    message["usage"] = {"input_tokens": generation.num_prompt_tokens, "output_tokens": 0}
    yield _event("message_start", {"message": message})
    async with aclosing(generation.chunks()) as chunks:
        try:
            async for payloads in chunks:
                events: list[bytes] = []
                for payload in payloads:
                    if payload.get("usage"):
                        output_tokens = payload["usage"]["completion_tokens"]
                    for choice in payload["choices"]:
                        events += _chunk_events(blocks, choice["delta"])
                        if choice["finish_reason"] is not None:
                            stop = _stop(choice["finish_reason"], choice.get("stop_reason"))
                if events:
                    yield b"".join(events)
        except APIError as exc:
            yield _event("error", {"error": anthropic_error_body(exc)["error"]})
            return
    tail = blocks.close()
    tail.append(_event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                         "usage": {"output_tokens": output_tokens}}))
    tail.append(_event("message_stop", {}))
    yield b"".join(tail)


def add_anthropic_routes(app: FastAPI, serving: Serving, authorized: list[Depends], task: str = "generate") -> None:
    thinks = serving.reasoning_parser is not None  # the model thinks unless the request says not to

    @app.post(PATH_PREFIX, dependencies=authorized)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        try:
            task_refusal(task, "generate", PATH_PREFIX)
            chat = body.chat(thinks)
            await serving.check_chat_grammars(chat)  # a forced tool's deep schema converts off the loop
            generation = serving.start_chat(chat, request, include_usage=True)
            model = serving.response_model_name(chat.model)
        except APIError as exc:
            raise in_surface_terms(exc, CHAT_FIELDS, body.origins(), MESSAGE_PARTS) from None
        if not body.stream:
            return JSONResponse(full_message(await generation.full(), model))
        await generation.start_stream()
        return StreamingResponse(stream_events(generation, model),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post(PATH_PREFIX + "/count_tokens", dependencies=authorized)
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        try:
            return {"input_tokens": serving.count_chat_prompt(body.chat_request(thinks))}
        except APIError as exc:
            raise in_surface_terms(exc, CHAT_FIELDS, body.origins(), MESSAGE_PARTS) from None
