"""Chat choices with the reasoning apart: ``message.reasoning_content`` in a full response,
``delta.reasoning_content`` while streaming (vLLM's field names).

It wraps the renderer of the content (ChatFormat, or ToolCallChoices when tools are parsed), so
tool calls are looked for in the content only. Each stream chunk carries what the reasoning
and the content grew by since the last one (think_tags.py holds back what may become a tag).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagedserve.client.detokenizer import Decodes
from pagedserve.frontend_proc.reasoning.think_tags import ReasoningSplit, ThinkTagParser
from pagedserve.frontend_proc.reasoning.token_count import reasoning_token_count
from pagedserve.frontend_proc.response_format import ChatFormat, LogprobEntries


@dataclass(slots=True)
class _Streamed:
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0
    content_start: Optional[int] = None  # where the content begins in text, once it has begun


class ReasoningChoices:
    def __init__(self, fmt: ChatFormat, inner: Any, parser: ThinkTagParser, num_choices: int,
                 end_ids: Sequence[int] = ()):
        self.fmt = fmt
        self.end_ids = end_ids  # the end tag's token ids: reasoning_tokens' fast path
        self.inner = inner  # ChatFormat or ToolCallChoices: renders the content
        self.parser = parser
        self._streamed = [_Streamed() for _ in range(num_choices)]

    def full_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                    finish_reason: Optional[str], *more: Any) -> dict[str, Any]:
        self._streamed[index].text = text
        split = self.parser.split(text, True)
        choice = self.inner.full_choice(index, split.content, logprobs, finish_reason, *more)
        message = choice["message"]
        message["reasoning_content"] = split.reasoning or None
        if message.get("content") == "":
            message["content"] = None  # the thinking took the whole output (vLLM's null)
        return choice

    def chunk_choice(self, index: int, text: str, logprobs: Optional[LogprobEntries],
                     finish_reason: Optional[str], *more: Any) -> Optional[dict[str, Any]]:
        state = self._streamed[index]
        state.text += text
        if state.content_start is not None:
            # The reasoning ended where it will always have ended (the first end tag): splitting
            # again would only rescan the whole output, per token.
            reasoning, content = "", state.text[state.content_start + state.content_sent:]
            state.content_sent += len(content)
        else:
            split: ReasoningSplit = self.parser.split(state.text, finish_reason is not None)
            reasoning = split.reasoning[state.reasoning_sent:]
            content = split.content[state.content_sent:]
            state.reasoning_sent, state.content_sent = len(split.reasoning), len(split.content)
            if split.content:  # always a suffix of the text
                state.content_start = len(state.text) - len(split.content)
        if not reasoning and not content and finish_reason is None and logprobs is None:
            return None
        choice = self.inner.chunk_choice(index, content, logprobs, finish_reason, *more)
        if reasoning:
            if choice is None:
                choice = self.fmt.chunk_choice(index, "", None, None, *more)
            if not content and choice["delta"].get("content") == "":
                del choice["delta"]["content"]
            choice["delta"]["reasoning_content"] = reasoning
        return choice

    def reasoning_tokens(self, index: int, token_ids: list[int], decoder: Decodes) -> int:
        """Choice ``index``'s thinking tokens, once its whole text has been rendered."""
        return reasoning_token_count(self.parser, self._streamed[index].text, token_ids, decoder, self.end_ids)
