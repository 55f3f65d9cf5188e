"""``LLM.chat``'s prompts: conversations rendered by the HTTP frontend's own chat code.

The offline LLM plays the frontend of its engine, so it renders a conversation with
``PromptTokenizer.encode_chat`` (client/tokenization.py), the function /v1/chat/completions
uses: the two cannot render one conversation differently. Imported lazily, on the first
``chat()``: pydantic and jinja are not needed before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

from pagedserve.protocol.validate import InvalidField, unencodable_string

Conversation = list[dict[str, Any]]  # [{"role": ..., "content": ...}, ...]


def chat_prompt_tokenizer(model_dir: str, chat_template: Optional[str]):
    """The PromptTokenizer the frontend uses, for the model (``chat_template``: a file or the text)."""
    from pagedserve.client.tokenization import PromptTokenizer

    return PromptTokenizer(Path(model_dir), chat_template)


def _conversations(messages: Any) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them, as vLLM takes them."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidField("messages", "expected a conversation (a non-empty list of message dicts) "
                                       "or a list of conversations")
    if isinstance(messages[0], dict):
        return [list(messages)]
    return [list(c) if isinstance(c, (list, tuple)) else c for c in messages]


def render_conversations(tokenizer, messages: Union[Conversation, Sequence[Conversation]],
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[list[int]]:
    """Each conversation's prompt token ids; a bad one raises InvalidField naming it."""
    from pydantic import ValidationError

    from pagedserve.client.chat_template_options import ChatTemplateOptions
    from pagedserve.client.errors import APIError
    from pagedserve.client.chat_messages import ChatMessage

    found = unencodable_string({"messages": messages, "chat_template_kwargs": chat_template_kwargs})
    if found:  # what the HTTP frontend refuses with a 400 (protocol/validate.py)
        raise InvalidField(*found)
    try:
        options = ChatTemplateOptions.from_request(add_generation_prompt, continue_final_message,
                                                   chat_template_kwargs)
    except APIError as exc:
        raise InvalidField(exc.param or "chat_template_kwargs", exc.message) from None

    prompts = []
    for i, conversation in enumerate(_conversations(messages)):
        if not isinstance(conversation, list) or not conversation:
            raise InvalidField("messages", f"conversation {i} is not a non-empty list of messages")
        try:
            parsed = [ChatMessage.model_validate(message) for message in conversation]
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise InvalidField("messages", f"conversation {i}: {where}: {first.get('msg')}") from None
        try:
            prompts.append(tokenizer.encode_chat(parsed, options))
        except APIError as exc:
            raise InvalidField("messages", f"conversation {i}: {exc.message}") from None
    return prompts
