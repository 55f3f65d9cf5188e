"""``/v1/responses``: OpenAI's Responses API (stateless) over the chat path.

A request is translated into a chat request (responses_schema.py) and served by
``Serving.start_chat``; its chat payloads become the Response object's output items (a
``reasoning`` item when --reasoning-parser split one off, a ``message`` of ``output_text``,
``function_call`` items), or, streaming, OpenAI's event sequence: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` / ``.done`` around
``response.content_part.added``, ``response.output_text.delta`` (``reasoning_text``,
``function_call_arguments``), ``...done``, ``response.content_part.done``; then
``response.completed`` (``response.incomplete`` when cut by max_output_tokens). Every event
carries its ``sequence_number``. An error after the stream began is an ``error`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.frontend_proc.embeddings_api import task_refusal
from pagedserve.frontend_proc.errors import APIError, in_surface_terms
from pagedserve.frontend_proc.generation import Generation
from pagedserve.frontend_proc.responses_schema import MESSAGE_PARTS, ResponsesRequest
from pagedserve.frontend_proc.serving import Serving


# chat request field -> the Responses field it came from, for refusals that name one
CHAT_FIELDS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input",
               "chat_template_kwargs": "reasoning.effort"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The Response object of one request: what the request asked, what the model wrote."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body = body
        self.id = _id("resp")
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []

    def response(self, status: str, usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        choice = b.tool_choice if b.tool_choice is not None else ("auto" if b.tools else "none")
        response = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {}, "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": b.reasoning.model_dump(exclude_none=True) if b.reasoning is not None else None,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else {"type": "function", "name": choice.name},
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": t.strict} for t in b.tools or []],
            "truncation": "disabled",
        }
        if usage is not None:  # not nullable in OpenAI's schema: absent until the response is done
            response["usage"] = usage
        return response


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get(
                "completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: Optional[str]) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def full_response(builder: ResponseBuilder, payload: dict[str, Any]) -> dict[str, Any]:
    choice = payload["choices"][0]
    message, status = choice["message"], _status(choice["finish_reason"])
    if message.get("reasoning_content"):
        builder.output.append(reasoning_item(message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or builder.output):  # never an empty output list
        builder.output.append(message_item(message.get("content") or "", status))
    for call in calls:
        builder.output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
    return builder.response(status, _usage(payload["usage"]))


class _EventStream:
    """Chat deltas as Responses events: one output item open at a time."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder
        self.sequence = 0
        self.open: Optional[tuple[str, Optional[int]]] = None  # (kind, tool call index)

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    @property
    def item(self) -> dict[str, Any]:
        return self.builder.output[-1]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.builder.output) - 1}

    def switch(self, kind: str, call: Optional[int], item: dict[str, Any]) -> list[bytes]:
        if self.open == (kind, call):
            return []
        events = self.close("completed")
        self.open = (kind, call)
        self.builder.output.append(item)
        added = {**item, "status": "in_progress"}
        if kind != "function_call":
            part = item["content"][0]
            added["content"] = []
            events.append(self.event("response.output_item.added", output_index=len(self.builder.output) - 1,
                                     item=added))
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=part.copy()))
        else:
            events.append(self.event("response.output_item.added", output_index=len(self.builder.output) - 1,
                                     item=added))
        return events

    def close(self, status: str) -> list[bytes]:
        if self.open is None:
            return []
        kind, _ = self.open
        self.open = None
        item = self.item
        item["status"] = status
        events = []
        if kind == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", **self._where(), content_index=0,
                                     text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", **self._where(), content_index=0, part=part))
        elif kind == "reasoning":
            part = item["content"][0]
            events.append(self.event("response.reasoning_text.done", **self._where(), content_index=0,
                                     text=part["text"]))
            events.append(self.event("response.content_part.done", **self._where(), content_index=0, part=part))
        else:
            events.append(self.event("response.function_call_arguments.done", **self._where(),
                                     name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=len(self.builder.output) - 1,
                                 item=item))
        return events

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if delta.get("reasoning_content"):
            events += self.switch("reasoning", None, reasoning_item("", "in_progress"))
            self.item["content"][0]["text"] += delta["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                     delta=delta["reasoning_content"]))
        if delta.get("content"):
            events += self.switch("message", None, message_item("", "in_progress"))
            self.item["content"][0]["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                     delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                events += self.switch("function_call", call["index"], call_item(
                    call["id"], call["function"]["name"], "", "in_progress"))
            arguments = call["function"].get("arguments")
            if arguments:
                self.item["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", **self._where(),
                                         delta=arguments))
        return events


async def stream_events(builder: ResponseBuilder, generation: Generation) -> AsyncIterator[bytes]:
    events = _EventStream(builder)
    yield events.event("response.created", response=builder.response("in_progress"))
    yield events.event("response.in_progress", response=builder.response("in_progress"))
    finish_reason, usage = None, None
    async with aclosing(generation.chunks()) as chunks:
        try:
            async for payloads in chunks:
                out: list[bytes] = []
                for payload in payloads:
                    usage = payload.get("usage") or usage
                    for choice in payload["choices"]:
                        out += events.delta(choice["delta"])
                        finish_reason = choice["finish_reason"] or finish_reason
                if out:
                    yield b"".join(out)
        except APIError as exc:
            error = exc.body()["error"]
            yield events.event("error", code=error.get("code") or error["type"], message=error["message"],
                               param=error.get("param"))
            return
    status = _status(finish_reason)
    tail = events.close(status)
    if not builder.output:  # nothing was written: still one (empty) message, as the full response has
        tail += events.switch("message", None, message_item("", "in_progress")) + events.close(status)
    response = builder.response(status, _usage(usage) if usage else None)
    tail.append(events.event(f"response.{status}", response=response))
    yield b"".join(tail)


def add_responses_routes(app: FastAPI, serving: Serving, authorized: list[Depends], task: str = "generate") -> None:
    @app.post("/v1/responses", dependencies=authorized)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        try:
            task_refusal(task, "generate", "/v1/responses")
            builder = ResponseBuilder(body, serving.response_model_name(body.model))
            chat = body.chat()
            await serving.check_chat_grammars(chat)  # a deep text.format schema converts off the loop
            generation = serving.start_chat(chat, request, include_usage=True)
        except APIError as exc:
            raise in_surface_terms(exc, CHAT_FIELDS, body.origins(), MESSAGE_PARTS) from None
        if not body.stream:
            return JSONResponse(full_response(builder, await generation.full()))
        await generation.start_stream()
        return StreamingResponse(stream_events(builder, generation), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
