"""Anthropic's Messages API request (``/v1/messages``, ``/v1/messages/count_tokens``), and its
translation into the chat request the rest of the frontend serves.

The subset served: ``system``; user and assistant messages of text, ``tool_use`` and
``tool_result`` blocks, an assistant's ``thinking`` blocks as chat's ``reasoning_content`` (for
templates that show an earlier turn's thinking); a final assistant message of text as a prefill
the reply continues (chat's ``continue_final_message``); ``max_tokens``, ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``; ``tools`` and ``tool_choice``; ``stream``;
``metadata.user_id`` as chat's ``user`` (the tenant, frontend_proc/tenant.py); ``thinking``
``{"type": "disabled"}`` as Qwen3's ``enable_thinking: false``. ``cache_control``
marks are accepted anywhere: they are caching hints, and this server's prefix cache is the
operator's (``--enable-prefix-caching``). Any other field, or a field another variant of the
same object has (``tool_choice``, ``thinking``), is a 400 naming it, never ignored.
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
    # the chat templates render a tool message without an error flag, so the model could not tell
    "is_error": "only tool results that are not errors are supported; say so in the content",
}
NEUTRAL = {"service_tier": ("auto", "standard_only"), "is_error": (False, None)}
ACCEPTED = frozenset({"cache_control"})
# a chat message's reasoning_content is its Anthropic message's thinking blocks (in_surface_terms' parts)
MESSAGE_PARTS = {".reasoning_content": (".content", ".content: thinking blocks")}


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
    # is_error is left undeclared: refuse_unknown refuses true (REASONS), NEUTRAL lets false and null through

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Anthropic):
    type: Literal["thinking"]
    thinking: str
    # Anthropic's proof the block is its model's; this server signs nothing (it sends ""), so
    # there is nothing to check the value against
    signature: str


class RedactedThinkingBlock(_Anthropic):
    """Declared so that it is refused by name rather than as an unknown block."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]


class Message(_Anthropic):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(_Anthropic):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None  # server tools (web search, bash, ...) are not served


# tool_choice and thinking as Anthropic's variants, so a key of another variant is refused by name
class ToolChoiceAuto(_Anthropic):
    type: Literal["auto"]
    disable_parallel_tool_use: Optional[bool] = None


class ToolChoiceAny(_Anthropic):
    type: Literal["any"]
    disable_parallel_tool_use: Optional[bool] = None


class ToolChoiceTool(_Anthropic):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: Optional[bool] = None


class ToolChoiceNone(_Anthropic):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class ThinkingEnabled(_Anthropic):
    type: Literal["enabled"]
    budget_tokens: int


class ThinkingDisabled(_Anthropic):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingDisabled], Field(discriminator="type")]


class Metadata(_Anthropic):
    user_id: Optional[str] = Field(default=None, max_length=256)


class CountTokensRequest(_Anthropic, EncodableStrings):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Optional[Union[str, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    # "disabled": Qwen3's enable_thinking false; "enabled" (a budget) is refused (REASONS)
    thinking: Optional[Thinking] = None
    # describes the caller (count_tokens takes it too): user_id names the tenant, as chat's user
    metadata: Optional[Metadata] = None

    def chat_request(self, thinks: bool = False, **sampling: Any) -> ChatCompletionRequest:
        """The chat request this asks for (raises InvalidRequest naming a field). ``thinks``: the
        server splits off thinking (--reasoning-parser), so the model thinks unless told not to."""
        refuse_unknown(self, "")
        messages = [] if self.system is None else [{"role": "system", "content": _system_text(self.system)}]
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, i)
        fields: dict[str, Any] = {"model": self.model, "messages": messages, **sampling}
        if _is_prefill(self.messages[-1]):
            _check_prefill(messages[-1]["content"], len(self.messages) - 1, thinks and self.thinking is None)
            messages[-1]["content"] = messages[-1]["content"] or ""  # thinking alone: continue after it
            fields.update(add_generation_prompt=False, continue_final_message=True)
        if self.metadata is not None and self.metadata.user_id is not None:
            fields["user"] = self.metadata.user_id
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

    def origins(self) -> list[str]:
        """Where each message of the chat request came from (errors.in_surface_terms)."""
        origins = ["system"] * (self.system is not None)
        return origins + [f"messages[{i}]" for i, message in enumerate(self.messages)
                          for _ in _chat_messages(message, i)]


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(gt=0)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: bool = False

    def chat(self, thinks: bool = False) -> ChatCompletionRequest:
        sampling = {"max_tokens": self.max_tokens, "stream": self.stream,
                    **{k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                         ("top_k", self.top_k), ("stop", self.stop_sequences))
                       if v is not None}}
        return self.chat_request(thinks, **sampling)


def refuse_unknown(model: BaseModel, prefix: str) -> None:
    """A 400 naming the first field the request sends that this server would have to ignore."""
    for name, value in (model.model_extra or {}).items():
        if name in ACCEPTED or any(type(value) is type(v) and value == v for v in NEUTRAL.get(name, ())):
            continue
        reason = REASONS.get(name) or _not_a_field(model)
        raise InvalidRequest(f"{prefix}{name} is not supported: {reason}", param=prefix + name)
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                refuse_unknown(item, where)


def _not_a_field(model: BaseModel) -> str:
    kind = getattr(model, "type", None)
    if isinstance(kind, str):
        return f"it is not a field of {{\"type\": \"{kind}\"}} in Anthropic's Messages API"
    return "it is not a field of Anthropic's Messages API this server knows"


def _is_prefill(message: Message) -> bool:
    """Anthropic continues a final assistant message's text (a prefill) instead of starting a
    new turn; one with tool uses is not a text to continue."""
    return message.role == "assistant" and (
        isinstance(message.content, str) or not any(isinstance(b, ToolUseBlock) for b in message.content))


def _check_prefill(text: Optional[str], i: int, thinks: bool) -> None:
    if text and text != text.rstrip():
        raise InvalidRequest(f"messages[{i}]: final assistant content cannot end with trailing whitespace",
                             param="messages")
    # Anthropic refuses a prefill while the model thinks
    if thinks:
        raise InvalidRequest(f"messages[{i}]: a final assistant message (a prefill) cannot be continued while "
                             f"the model thinks; send thinking {{\"type\": \"disabled\"}}", param="messages")


def _system_text(system: Union[str, list[TextBlock]]) -> str:
    return system if isinstance(system, str) else "\n".join(b.text for b in system)


def _chat_messages(message: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become tool messages
    (first, as Anthropic requires them first), an assistant's tool uses its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    for j, block in enumerate(message.content):
        if isinstance(block, RedactedThinkingBlock):
            raise InvalidRequest(f"messages[{i}].content[{j}]: redacted_thinking blocks are not supported: this "
                                 f"server never sends them and cannot read them", param=f"messages[{i}].content[{j}]")
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    thoughts = [b.thinking for b in message.content if isinstance(b, ThinkingBlock)]
    if message.role == "user":
        if uses or thoughts:
            kind = "tool_use" if uses else "thinking"
            raise InvalidRequest(f"messages[{i}]: {kind} blocks belong to assistant messages", param="messages")
        out = [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()} for r in results]
        return out + ([{"role": "user", "content": "".join(texts)}] if texts else [])
    if results:
        raise InvalidRequest(f"messages[{i}]: tool_result blocks belong to user messages", param="messages")
    chat: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thoughts:
        chat["reasoning_content"] = "\n\n".join(thoughts)
    if uses:
        chat["tool_calls"] = [{"id": u.id, "type": "function",
                               "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses]
    return [chat]


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if getattr(choice, "disable_parallel_tool_use", None) is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields
