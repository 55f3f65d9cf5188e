"""Incremental detokenization that never emits half a character.

Two implementations of one contract: ``add(new_ids)`` returns the text that became
complete, ``flush()`` at the end returns whatever is left (even an invalid byte tail), and
the pieces joined equal ``tokenizer.decode(all_ids)`` (special tokens skipped unless the
decoder's ``skip_special_tokens`` is false).

- ``StreamDetokenizer``: the tokenizers library's ``DecodeStream`` (Rust), which keeps its
  own small window of context; a step costs the same whatever the sequence length.
- ``WindowDetokenizer``: the prefix-offset / read-offset method (as in vLLM and TGI) in
  Python, for tokenizers without a fast backend: decode a small window twice, with and
  without the newest tokens, and emit the difference once it does not end in U+FFFD.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

REPLACEMENT_CHAR = "\ufffd"

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class Decodes(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class TextDecoder:
    """A Hugging Face tokenizer as the detokenizer wants it: special tokens are not text
    unless ``skip_special_tokens`` is false (vLLM's request field of that name)."""

    def __init__(self, hf_tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = hf_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream_backend = fast_backend(hf_tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class Detokenizer(Protocol):
    def add(self, new_token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class WindowDetokenizer:
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


class StreamDetokenizer:
    """``backend`` is a ``tokenizers.Tokenizer``; ``full_decode`` decodes a whole id list the
    way the reference does, used once at the end when bytes of a character are left over."""

    def __init__(self, backend: Any, full_decode: Decodes, skip_special_tokens: bool = True):
        self._backend = backend
        self._full = full_decode
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self._emitted_chars = 0
        self._pending = False  # tokens since the last chunk the stream gave back

    def add(self, new_token_ids: list[int]) -> str:
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        text = ""
        for token_id in new_token_ids:  # one id per call: older DecodeStreams take no lists
            chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                self._pending = True
            else:
                self._pending = False
                text += chunk
        self._emitted_chars += len(text)
        return text

    def flush(self) -> str:
        if not self._pending:
            return ""
        self._pending = False
        rest = self._full.decode(self.token_ids)[self._emitted_chars:]
        self._emitted_chars += len(rest)
        return rest


def fast_backend(hf_tokenizer: Any) -> Optional[Any]:
    """The ``tokenizers.Tokenizer`` that streaming decoding can use, when its output equals
    ``decode``'s: a fast tokenizer with no post-decode space clean-up."""
    if not getattr(hf_tokenizer, "is_fast", False):
        return None
    if getattr(hf_tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return getattr(hf_tokenizer, "backend_tokenizer", None)


def make_detokenizer(tokenizer: Decodes, backend: Optional[Any] = None) -> Detokenizer:
    """The streaming decoder when there is a fast backend (and DecodeStream exists)."""
    if backend is not None and DecodeStream is not None:
        return StreamDetokenizer(backend, tokenizer, getattr(tokenizer, "skip_special_tokens", True))
    return WindowDetokenizer(tokenizer)
