"""Chat choices whose output may hold tool calls: ``message.tool_calls`` in a full response,
OpenAI's tool-call deltas in a stream.

A stream announces each call once its name is known (index, id, type, function.name and the
arguments so far), then sends only what its arguments grew by. Arguments are raw slices of
the output (tool_parsers/base.py), so the fragments concatenate to the full response's call.
A choice that made calls and stopped on its own, every call whole, ends with ``finish_reason:
"tool_calls"``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.frontend_proc.response_format import ChatFormat, LogprobEntries
from pagedserve.frontend_proc.tool_parsers import PartialCall, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(finish_reason: Optional[str], calls: list[PartialCall]) -> Optional[str]:
    """"tool_calls" for a choice that stopped with its calls whole; a call a stop string cut
    short (its arguments unclosed) leaves "stop", as max_tokens leaves "length"."""
    whole = bool(calls) and all(c.complete for c in calls)
    return "tool_calls" if whole and finish_reason == "stop" else finish_reason


@dataclass(slots=True)
class _StreamedChoice:
    text: str = ""
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)  # one per announced call, by index
    arguments_sent: list[int] = field(default_factory=list)


class ToolCallChoices:
    """Drop-in for ChatFormat's full_choice / chunk_choice on requests that use tools."""

    def __init__(self, fmt: ChatFormat, parser: ToolParser, num_choices: int,
                 parallel_tool_calls: bool = True, calls_as_they_grow: bool = True):
        self.fmt = fmt
        self.parser = parser
        # A grammar (a forced tool choice) guarantees the calls' shape, so they stream as they grow.
        # Without one, only the whole output tells whether its calls are well formed (a malformed
        # one makes all of it content, vLLM's rule): calls are streamed at its end, as the
        # full response would hold them, never announced and then taken back as text.
        self.calls_as_they_grow = calls_as_they_grow
        self.max_calls = None if parallel_tool_calls else 1
        self._streamed = [_StreamedChoice() for _ in range(num_choices)]

    def _calls(self, calls: list[PartialCall]) -> list[PartialCall]:
        return calls[:self.max_calls]

    # ``*more``: whatever else the format's methods take (passed through unchanged).
    def full_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                    finish_reason: Optional[str], *more: Any) -> dict[str, Any]:
        parsed = self.parser(text, True)
        calls = [c for c in self._calls(parsed.calls) if c.name is not None]
        if not calls:
            return self.fmt.full_choice(index, parsed.content, logprobs, finish_reason, *more)
        choice = self.fmt.full_choice(index, parsed.content, logprobs, _finish_reason(finish_reason, calls), *more)
        choice["message"]["content"] = parsed.content or None
        choice["message"]["tool_calls"] = [
            {"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return choice

    def chunk_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                     finish_reason: Optional[str], *more: Any) -> Optional[dict[str, Any]]:
        """The chunk for this piece of output; None when it shows nothing yet (text that may
        begin a tool call is held back until the next piece says)."""
        state = self._streamed[index]
        state.text += text
        parsed = self.parser(state.text, finish_reason is not None)
        content = parsed.content[state.content_sent:]
        state.content_sent = max(state.content_sent, len(parsed.content))
        calls = self._calls(parsed.calls) if self.calls_as_they_grow or finish_reason is not None else []
        deltas = self._call_deltas(state, calls)
        if not content and not deltas and finish_reason is None and logprobs is None:
            return None
        announced = calls[:len(state.call_ids)]
        choice = self.fmt.chunk_choice(index, content, logprobs, _finish_reason(finish_reason, announced), *more)
        if deltas:
            if not content:
                choice["delta"].pop("content", None)  # OpenAI's call deltas carry no content
            choice["delta"]["tool_calls"] = deltas
        return choice

    @staticmethod
    def _call_deltas(state: _StreamedChoice, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(calls):
            if index < len(state.call_ids):
                grown = call.arguments[state.arguments_sent[index]:]
                if grown:
                    deltas.append({"index": index, "function": {"arguments": grown}})
                    state.arguments_sent[index] = len(call.arguments)
            elif call.name is not None and index == len(state.call_ids):
                state.call_ids.append(new_call_id())
                state.arguments_sent.append(len(call.arguments))
                deltas.append({"index": index, "id": state.call_ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
        return deltas
