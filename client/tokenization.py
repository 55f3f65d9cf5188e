"""Prompts to token ids: the model dir's tokenizer, its chat template and its EOS ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

from pagedserve.client.chat_template_options import ChatTemplateOptions, template_messages
from pagedserve.client.errors import InvalidRequest
from pagedserve.client.chat_messages import ChatMessage
from pagedserve.client.detokenizer import fast_backend

log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class PromptTokenizer:
    """Wraps the HF tokenizer of one model directory."""

    def __init__(self, model_dir: Path, chat_template: Optional[str] = None):
        from transformers import AutoTokenizer  # heavy import: only in this process

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:  # --chat-template: a file, or the template text itself
            path = Path(chat_template)
            self.tokenizer.chat_template = path.read_text() if path.is_file() else chat_template
        config = _read_json(model_dir / "config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        # The embedding's rows: the model may have more than the tokenizer has tokens, and an
        # id at or above them is an index no worker can look up.
        self.vocab_size = int(config.get("vocab_size") or 0) or len(self.tokenizer)
        eos = _as_id_list(generation_config.get("eos_token_id", config.get("eos_token_id")))
        if self.tokenizer.eos_token_id is not None:
            eos.append(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = sorted(set(eos))
        self.stream_backend = fast_backend(self.tokenizer)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_prompt(self, prompt: Union[str, list[int]]) -> list[int]:
        """Token ids given as such are checked with the rest of the request (protocol/validate.py)."""
        if isinstance(prompt, str):
            return self.encode_text(prompt)
        return list(prompt)

    def encode_chat(self, messages: list[ChatMessage],
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        conversation = template_messages(messages)
        if isinstance(template, str):
            options.check_template_reads_kwargs(template)
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, tools=options.tools, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=True,
                **options.template_kwargs)
        except Exception as exc:  # template errors (jinja) are the client's input problem
            raise InvalidRequest(f"cannot apply the chat template: {exc}",
                                 param="messages") from None
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs entries."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
