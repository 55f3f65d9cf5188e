"""Prompts to token ids: the model dir's tokenizer, its chat template and its EOS ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

from pagedserve.frontend_proc.detokenizer import Detokenizer, make_detokenizer
from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatMessage

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

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer  # heavy import: only in this process

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        config = _read_json(model_dir / "config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        # The model may have more embedding rows than the tokenizer has tokens.
        self.vocab_size = max(int(config.get("vocab_size") or 0), len(self.tokenizer))
        eos = _as_id_list(generation_config.get("eos_token_id", config.get("eos_token_id")))
        if self.tokenizer.eos_token_id is not None:
            eos.append(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = sorted(set(eos))
        self._stream_backend = self.stream_backend()

    def encode_prompt(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                param="prompt")
        return list(prompt)

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True)
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

    def stream_backend(self) -> Optional[Any]:
        """The ``tokenizers.Tokenizer`` that streaming decoding can use, when its output equals
        ``decode``'s: a fast tokenizer with no post-decode space clean-up."""
        if not getattr(self.tokenizer, "is_fast", False):
            return None
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return None
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def make_detokenizer(self) -> Detokenizer:
        return make_detokenizer(self, self._stream_backend)
