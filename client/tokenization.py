"""Prompts to token ids: the model dir's tokenizer, its chat template and its EOS ids."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from pagedserve.client.chat_template_options import (ChatTemplateOptions, check_template_reads_reasoning,
                                                     template_messages)
from pagedserve.client.errors import InvalidRequest
from pagedserve.client.chat_messages import ChatMessage
from pagedserve.client.detokenizer import fast_backend
from pagedserve.client.model_files import eos_token_ids, vocab_size


class PromptTokenizer:
    """Wraps the HF tokenizer of one model directory."""

    def __init__(self, model_dir: Path, chat_template: Optional[str] = None):
        from transformers import AutoTokenizer  # heavy import: only in this process

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:  # --chat-template: a file, or the template text itself
            path = Path(chat_template)
            self.tokenizer.chat_template = path.read_text() if path.is_file() else chat_template
        self.vocab_size = vocab_size(model_dir, self.tokenizer)
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        self.stream_backend = fast_backend(self.tokenizer)
        self.special_ids = frozenset(self.tokenizer.all_special_ids)  # what skip_special_tokens leaves out

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
            check_template_reads_reasoning(messages, template)
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
