"""OpenAI's Responses API request (``/v1/responses``), the stateless subset, and its translation
into the chat request the rest of the frontend serves.

Served: ``input`` as a string or as items (messages of text parts, ``function_call``,
``function_call_output``, and ``reasoning``, whose text becomes the ``reasoning_content`` of the
assistant turn it opens, for a template that shows an earlier turn's thinking),
``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema),
``stream`` (``stream_options`` only with it), ``reasoning.effort: "none"`` (Qwen3's ``enable_thinking:
false``). Nothing is stored: ``store: true``,
``previous_response_id`` and ``conversation`` are 400s that say so (a store would have to live
across frontend restarts and replicas to be worth having). Every other field of OpenAI's schema
is refused by name unless it only describes the caller or is at its neutral value, each judged
where it belongs (an item's ``id`` is not a request's).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, Discriminator, Field, PrivateAttr, Tag, ValidationError

from pagedserve.client.chat_messages import Lenient
from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, EncodableStrings

STATELESS = "this server stores no responses; send the whole conversation as input"
REASONS = {
    "store": STATELESS,
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "background": "background responses are not supported",
    "truncation": "inputs are never truncated; a too long one is a 400",
    "include": "no additional output data is available",
    "reasoning": "only effort \"none\" (thinking off, where the chat template reads enable_thinking) "
                 "is served; a model served with --reasoning-parser returns its thinking as a reasoning item",
    "top_logprobs": "logprobs are not returned by /v1/responses; use /v1/chat/completions",
    "logprobs": "logprobs are not returned by /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "the number of tool calls is not limited here; use parallel_tool_calls",
    "prompt": "prompt templates are not supported",
    "moderation": "moderation is not supported",
    "context_management": "context management is not supported",
    "service_tier": "there is one service tier: auto",
    "prompt_cache_options": "the prefix cache is configured by the operator (--enable-prefix-caching)",
    "prompt_cache_retention": "the prefix cache is configured by the operator (--enable-prefix-caching)",
    "verbosity": "verbosity is not configurable",
    "include_obfuscation": "stream events carry no obfuscation padding",
    "include_usage": "a Responses stream always ends with its usage, in response.completed",
    "encrypted_content": "this server cannot read encrypted reasoning; send the reasoning item's content "
                         "as this server returned it",
}
# a chat message's reasoning_content is the reasoning item that opened its turn (in_surface_terms' parts)
MESSAGE_PARTS = {".reasoning_content": ("", "")}
ABOUT_THE_CALLER = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})
Neutral = dict[str, Optional[tuple[Any, ...]]]  # undeclared field -> its accepted values (None: any)


class Echoed(Lenient):
    """An input item or content part, which a client sends back as an earlier response gave it."""

    # they name or describe the item there and change nothing here; at the top level they would
    NEUTRAL: ClassVar[Neutral] = dict.fromkeys(("id", "status", "annotations", "logprobs"))


class TextPart(Echoed):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(Echoed):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Echoed):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(Echoed):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(Echoed):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(Echoed):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Echoed):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: Optional[list[ReasoningText]] = None

    def thinking(self) -> str:
        # the content is the thinking itself and the summary a digest of it: the summary stands
        # in only where the content is missing (vLLM's rule too)
        if self.content:
            return "".join(p.text for p in self.content)
        return "\n\n".join(p.text for p in self.summary)


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type)]


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ReasoningOptions(Lenient):
    # "none" switches the thinking off (Qwen3's enable_thinking false, where the template reads
    # it); other efforts cannot be honoured by a template switch, so they are refused
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


class TextOptions(Lenient):
    NEUTRAL: ClassVar[Neutral] = {"verbosity": ("medium",)}
    format: Optional[TextFormat] = None


class ResponseStreamOptions(Lenient):
    """Responses' own stream options (OpenAI's ``ResponseStreamOptions``): only
    ``include_obfuscation``, and chat's ``include_usage`` is no field of it."""

    NEUTRAL: ClassVar[Neutral] = {"include_obfuscation": (False,)}


class ResponsesRequest(Lenient, EncodableStrings):
    NEUTRAL: ClassVar[Neutral] = {
        "store": (False,), "background": (False,), "truncation": ("disabled",), "include": ([],),
        "service_tier": ("auto", "default"), **dict.fromkeys(ABOUT_THE_CALLER)}
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, gt=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    stream: Optional[bool] = None
    stream_options: Optional[ResponseStreamOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    metadata: Optional[dict[str, str]] = None  # describes the caller; echoed in the response
    # where each chat message came from, for errors.in_surface_terms (a message after a reasoning
    # item joins its turn, so the turn is named by the reasoning item)
    _origins: list[str] = PrivateAttr(default_factory=list)

    def chat(self) -> ChatCompletionRequest:
        """The chat request this asks for (raises InvalidRequest naming a field)."""
        refuse_unknown(self, "")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only for a streamed response (stream: true)",
                                 param="stream_options")
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        self._origins = ["instructions"] * len(messages)
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            self._origins.append("input")
        else:
            for i, item in enumerate(self.input):
                _append_item(messages, item, f"input[{i}]")
                self._origins += [f"input[{i}]"] * (len(messages) - len(self._origins))
        if not messages:
            raise InvalidRequest("input must not be empty", param="input")
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        for ours, theirs in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls)):
            if theirs is not None:
                fields[ours] = theirs
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type"}, include={"name", "description", "parameters", "strict"})}
                for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                     {"type": "function", "function": {"name": self.tool_choice.name}})
        if self.reasoning is not None:
            fields.update(_reasoning_fields(self.reasoning))
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            fields["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema}})
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise InvalidRequest(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None

    def origins(self) -> list[str]:
        """Where each message of the last chat() came from (errors.in_surface_terms)."""
        return self._origins


def _reasoning_fields(reasoning: ReasoningOptions) -> dict[str, Any]:
    if reasoning.summary is not None:
        raise InvalidRequest("reasoning.summary is not supported: the thinking comes back whole, as a "
                             "reasoning item's content", param="reasoning.summary")
    if reasoning.effort is None:
        return {}
    if reasoning.effort != "none":
        raise InvalidRequest(f"reasoning.effort {reasoning.effort!r} is not supported: {REASONS['reasoning']}",
                             param="reasoning.effort")
    return {"chat_template_kwargs": {"enable_thinking": False}}


def _append_item(messages: list[dict[str, Any]], item: Union[MessageItem, FunctionCallItem, FunctionCallOutputItem,
                                                             ReasoningItem], where: str) -> None:
    if isinstance(item, ReasoningItem):  # it opens the assistant turn whose message and calls follow
        if not item.content and not item.summary:
            raise InvalidRequest(f"{where}: a reasoning item without content names one stored by id; "
                                 f"{STATELESS}", param=where)
        messages.append({"role": "assistant", "content": None, "reasoning_content": item.thinking()})
    elif isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        last = messages[-1] if messages else {}
        if role == "assistant" and "reasoning_content" in last and last["content"] is None \
                and "tool_calls" not in last:
            last["content"] = item.text()  # the message of the turn its reasoning item opened
        else:
            messages.append({"role": role, "content": item.text()})
    elif isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    else:  # a call joins the assistant turn it belongs to
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def refuse_unknown(model: BaseModel, prefix: str) -> None:
    """A 400 naming the first field this server would have to ignore (nested models too, each
    with only its own class's ``NEUTRAL`` fields exempt)."""
    exempt: Neutral = getattr(model, "NEUTRAL", {})
    for name, value in (model.model_extra or {}).items():
        neutral = exempt.get(name, ())
        if value is None or neutral is None:
            continue
        if any(type(value) is type(v) and value == v for v in neutral):
            continue
        reason = REASONS.get(name, "it is not a field this server knows (a typo?)")
        raise InvalidRequest(f"{prefix}{name} is not supported: {reason}", param=prefix + name)
    for name in type(model).model_fields:
        value = getattr(model, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                refuse_unknown(item, f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}.")
