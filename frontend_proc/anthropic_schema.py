"""Anthropic's Messages API request (``/v1/messages``, ``/v1/messages/count_tokens``), and its
translation into the chat request the rest of the frontend serves.

The subset served: ``system``; user and assistant messages of text, ``tool_use`` and
``tool_result`` blocks; ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``;
``tools`` and ``tool_choice``; ``stream``; ``metadata`` (describes the caller); ``thinking``
``{"type": "disabled"}`` as Qwen3's ``enable_thinking: false``. ``cache_control``
marks are accepted anywhere: they are caching hints, and this server's prefix cache is the
operator's (``--enable-prefix-caching``). Any other field is a 400 naming it, never ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, EncodableStrings

REASONS = {
    "thinking": "thinking budgets are not enforced here; a reasoning model served with --reasoning-parser "
                "thinks by default and its thinking comes back as thinking blocks ({\"type\": \"disabled\"} "
                "switches it off where the chat template reads enable_thinking)",
    "service_tier": "there is one service tier",
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "citations": "citations are not supported",
    "is_error": "only tool results that are not errors are supported; say so in the content",
}
NEUTRAL = {"service_tier": ("auto", "standard_only")}
ACCEPTED = frozenset({"cache_control", "metadata"})


class _Anthropic(BaseModel):
    """Unknown fields are kept for ``refuse_unknown`` to name; types are strict."""

    model_config = ConfigDict(extra="allow", strict=True)


class TextBlock(_Anthropic):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Anthropic):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Anthropic):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Optional[Union[str, list[TextBlock]]] = None
    is_error: Optional[bool] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(_Anthropic):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(_Anthropic):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None  # server tools (web search, bash, ...) are not served


class ToolChoice(_Anthropic):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Anthropic):
    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = None


class CountTokensRequest(_Anthropic, EncodableStrings):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Optional[Union[str, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    # "disabled": Qwen3's enable_thinking false; "enabled" (a budget) is refused (REASONS)
    thinking: Optional[Thinking] = None

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat request this asks for (raises InvalidRequest naming a field)."""
        refuse_unknown(self, "")
        messages = [] if self.system is None else [{"role": "system", "content": _system_text(self.system)}]
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, i)
        fields: dict[str, Any] = {"model": self.model, "messages": messages, **sampling}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema}} for t in self.tools]
        if self.tool_choice is not None:
            fields.update(_tool_choice(self.tool_choice))
        if self.thinking is not None:
            if self.thinking.type != "disabled":
                raise InvalidRequest(f"thinking: {REASONS['thinking']}", param="thinking")
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise InvalidRequest(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(gt=0)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: bool = False

    def chat(self) -> ChatCompletionRequest:
        sampling = {"max_tokens": self.max_tokens, "stream": self.stream,
                    **{k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                         ("top_k", self.top_k), ("stop", self.stop_sequences))
                       if v is not None}}
        return self.chat_request(**sampling)


def refuse_unknown(model: BaseModel, prefix: str) -> None:
    """A 400 naming the first field the request sends that this server would have to ignore."""
    for name, value in (model.model_extra or {}).items():
        if name in ACCEPTED or any(type(value) is type(v) and value == v for v in NEUTRAL.get(name, ())):
            continue
        reason = REASONS.get(name, "it is not a field of Anthropic's Messages API this server knows")
        raise InvalidRequest(f"{prefix}{name} is not supported: {reason}", param=prefix + name)
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                refuse_unknown(item, where)


def _system_text(system: Union[str, list[TextBlock]]) -> str:
    return system if isinstance(system, str) else "\n".join(b.text for b in system)


def _chat_messages(message: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become tool messages
    (first, as Anthropic requires them first), an assistant's tool uses its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    if message.role == "user":
        if uses:
            raise InvalidRequest(f"messages[{i}]: tool_use blocks belong to assistant messages", param="messages")
        out = [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()} for r in results]
        return out + ([{"role": "user", "content": "".join(texts)}] if texts else [])
    if results:
        raise InvalidRequest(f"messages[{i}]: tool_result blocks belong to user messages", param="messages")
    chat: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if uses:
        chat["tool_calls"] = [{"id": u.id, "type": "function",
                               "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses]
    return [chat]


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("tool_choice: type tool needs the tool's name", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields
