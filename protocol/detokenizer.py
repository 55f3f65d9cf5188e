"""Incremental detokenization that never emits half a character.

The prefix-offset / read-offset method (as in vLLM and TGI): decode a small window of
tokens twice, with and without the newest tokens, and emit the difference only once it
does not end in U+FFFD, i.e. once every byte of the last character has arrived. Decoding
a window rather than single tokens also keeps tokenizer-specific joining (such as the
leading-space handling of SentencePiece) identical to decoding the whole sequence.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decodes(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class TextDecoder:
    """A Hugging Face tokenizer as the detokenizer wants it: special tokens are not text
    unless ``skip_special_tokens`` is false (vLLM's request field of that name)."""

    def __init__(self, hf_tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = hf_tokenizer
        self.skip_special_tokens = skip_special_tokens

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decodes):
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the window that gives context to new tokens
        self.read_offset = 0  # tokens before this have been emitted as text

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text that became complete (maybe empty)."""
        self.token_ids.extend(new_token_ids)
        return self._emit(allow_partial=False)

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is left, even an invalid byte tail."""
        return self._emit(allow_partial=True)

    def _emit(self, allow_partial: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._tokenizer.decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. special tokens, which decode to nothing
        if full_text.endswith(REPLACEMENT_CHAR) and not allow_partial:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]
