"""How a chat request asks its template to render: vLLM's ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` and the ``tools`` the template is shown.

vLLM's semantics: the two flags may not both be true; ``chat_template_kwargs`` become template
variables and override the two flags when they name them. Unlike vLLM, a kwarg the template
never reads is a 400 naming it rather than silently dropped (docs/DECISIONS.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

from pagedserve.client.errors import InvalidRequest

# apply_chat_template's own arguments and what the request already carries elsewhere.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens"})
_FLAGS = ("add_generation_prompt", "continue_final_message")


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict[str, Any]]] = None  # OpenAI tool definitions, as the template sees them
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_request(cls, add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: Optional[dict[str, Any]] = None,
                     tools: Optional[list[dict[str, Any]]] = None) -> "ChatTemplateOptions":
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs: {reserved} cannot be set here; use the "
                                 f"request's own fields", param="chat_template_kwargs")
        flags = {"add_generation_prompt": add_generation_prompt,
                 "continue_final_message": continue_final_message}
        for name in _FLAGS:
            if name in kwargs:
                if not isinstance(kwargs[name], bool):
                    raise InvalidRequest(f"chat_template_kwargs.{name} must be a boolean",
                                         param="chat_template_kwargs")
                flags[name] = kwargs.pop(name)
        if flags["add_generation_prompt"] and flags["continue_final_message"]:
            raise InvalidRequest("cannot set both continue_final_message and add_generation_prompt "
                                 "to true; set add_generation_prompt to false to continue the final "
                                 "message", param="continue_final_message")
        return cls(tools=tools, template_kwargs=kwargs, **flags)

    def check_template_reads_kwargs(self, template: str) -> None:
        """A kwarg the template has no variable for would change nothing: refuse it."""
        if not self.template_kwargs:
            return
        variables = template_variables(template)
        if variables is None:
            return
        unread = sorted(k for k in self.template_kwargs if k not in variables)
        if unread:
            raise InvalidRequest(f"chat_template_kwargs: the chat template does not use {unread}; "
                                 f"it reads {sorted(variables)}", param="chat_template_kwargs")


def check_template_reads_reasoning(messages: list, template: str) -> None:
    """An earlier turn's thinking the template never shows would change nothing: refuse it."""
    for i, message in enumerate(messages):
        if message.reasoning_content is not None and "reasoning_content" not in template:
            raise InvalidRequest(f"messages[{i}].reasoning_content: the chat template does not show an "
                                 f"earlier turn's thinking", param=f"messages[{i}].reasoning_content")


@lru_cache(maxsize=8)
def template_variables(template: str) -> Optional[frozenset[str]]:
    """The variables a Jinja template reads from its context (None: it cannot be parsed here)."""
    from jinja2 import TemplateSyntaxError, meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        environment = _compile_jinja_template(template).environment
        return frozenset(meta.find_undeclared_variables(environment.parse(template)))
    except (TemplateSyntaxError, AttributeError, ImportError):
        return None


def template_messages(messages: list) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: text content, and an assistant's earlier
    calls with their ``arguments`` parsed into objects (vLLM does the same: templates such as
    Qwen2.5's and Llama 3's write them with ``tojson``)."""
    conversation = []
    for i, message in enumerate(messages):
        try:
            entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        except ValueError as exc:
            raise InvalidRequest(f"messages[{i}]: {exc}", param="messages") from None
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                         f"valid JSON", param="messages") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            entry["tool_calls"] = calls
        conversation.append(entry)
    return conversation
