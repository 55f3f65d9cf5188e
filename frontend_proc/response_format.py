"""The OpenAI response shapes of /v1/completions and /v1/chat/completions, full and chunked."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

# Per token: (its text, its logprob, its top alternatives as (text, logprob), best first, whether
# the choice's text shows it); an echoed prompt's first token has None for both (completions only).
# A special token the text skips (skip_special_tokens) takes no room in text_offset.
LogprobEntries = list[tuple[str, Optional[float], Optional[list[tuple[str, float]]], bool]]
# vLLM's stop_reason: the stop string or requested stop token id that ended a choice, else None.
StopReason = Optional[Union[str, int]]


class CompletionFormat:
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                    finish_reason: Optional[str], stop_reason: StopReason = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(index, logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                     finish_reason: Optional[str], stop_reason: StopReason = None) -> dict[str, Any]:
        return self.full_choice(index, text, logprobs, finish_reason, stop_reason)

    def opening_chunk_choices(self, n: int) -> list[dict[str, Any]]:
        return []

    def _logprobs(self, index: int, entries: Optional[LogprobEntries]) -> Optional[dict]:
        if entries is None:
            return None
        offset = self._text_offsets.get(index, 0)
        offsets = []
        for token, _, _, shown in entries:
            offsets.append(offset)
            offset += len(token) if shown else 0
        self._text_offsets[index] = offset
        # vLLM's shape: the alternatives and the sampled token, keyed by text
        return {"tokens": [t for t, _, _, _ in entries],
                "token_logprobs": [lp for _, lp, _, _ in entries],
                "top_logprobs": [None if lp is None else _by_text([(t, lp), *top]) for t, lp, top, _ in entries],
                "text_offset": offsets}


def _by_text(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """Completions' top_logprobs are keyed by text: tokens whose texts collide (byte pieces
    that each decode to U+FFFD) keep the highest logprob among them."""
    table: dict[str, float] = {}
    for text, logprob in pairs:
        if text not in table or logprob > table[text]:
            table[text] = logprob
    return table


class ChatFormat(CompletionFormat):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def full_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                    finish_reason: Optional[str], stop_reason: StopReason = None) -> dict[str, Any]:
        # refusal: OpenAI's schema requires the key; this server never refuses by policy
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": self._logprobs(index, logprobs), "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                     finish_reason: Optional[str], stop_reason: StopReason = None) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(index, logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def opening_chunk_choices(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(n)]

    def _logprobs(self, index: int, entries: Optional[LogprobEntries]) -> Optional[dict]:
        if entries is None:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                              for a, alp in top]}
                            for t, lp, top, _ in entries],
                "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
