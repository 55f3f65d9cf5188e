"""Thinking between ``<think>`` and ``</think>``, split from the answer (vLLM's rules).

Where the reasoning starts:
- the output starts in reasoning, whether the chat template opened ``<think>`` in the prompt
  (Qwen3-Thinking-2507, Qwen3.5) or the model writes ``<think>`` itself (Qwen3, DeepSeek-R1-0528),
  or writes none at all (DeepSeek-R1); a ``<think>`` the model writes is dropped;
- unless the prompt already closed it (a template that ends the generation prompt with
  ``</think>``, as Qwen3's does for ``enable_thinking: false``), or, for ``qwen3``, the request
  set ``chat_template_kwargs.enable_thinking`` to false: then the output is all content.

Where it ends: at the first ``</think>``; for ``qwen3`` also at a ``<tool_call>`` followed by
``<function`` (Qwen3.5 may call a tool without closing its thinking), which begins the content.
A model that never closes its thinking (cut by max_tokens) returned reasoning only.

A split is a pure function of the text so far: while streaming, whatever could still turn
into a tag is held back, so the reasoning and the content each only grow, and a stream cut
anywhere adds up to the full response's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.frontend_proc.tool_parsers.base import held_back

START = "<think>"
END = "</think>"
TOOL_CALL = "<tool_call>"
FUNCTION = "<function"
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str  # a prefix that only grows while streaming
    content: str  # likewise; empty until the reasoning ended


@dataclass(frozen=True, slots=True)
class ThinkTagParser:
    name: str
    reads_enable_thinking: bool = False  # qwen3: enable_thinking false means no reasoning at all
    tool_call_ends_reasoning: bool = False  # qwen3: <tool_call><function= ends unclosed reasoning

    def starts_in_reasoning(self, prompt_tail: str, template_kwargs: Optional[dict[str, Any]]) -> bool:
        """Whether the output begins inside the thinking (``prompt_tail``: the prompt's last
        few tokens as text)."""
        if self.reads_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False:
            return False
        return not prompt_tail.rstrip(_WHITESPACE).endswith(END)

    def content_start(self, text: str) -> Optional[int]:
        """Where the content begins in a whole output that starts in reasoning (None: the
        thinking never ended)."""
        end = text.find(END)
        implicit = self._implicit_end(text, True, end)
        if implicit is not None:
            return implicit
        return end + len(END) if end >= 0 else None

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """The reasoning and content of an output that starts in reasoning."""
        end = text.find(END)
        implicit = self._implicit_end(text, final, end)
        if implicit is not None:
            return ReasoningSplit(_drop_start(text[:implicit]), text[implicit:])
        if end >= 0:
            return ReasoningSplit(_drop_start(text[:end]), text[end + len(END):])
        if not final:
            hold = max(held_back(text, END), held_back(text, START), self._tool_call_hold(text))
            text = text[:len(text) - hold]
        return ReasoningSplit(_drop_start(text), "")

    def _implicit_end(self, text: str, final: bool, end: int) -> Optional[int]:
        """Where a ``<tool_call><function`` before any ``</think>`` starts (None: nowhere)."""
        if not self.tool_call_ends_reasoning:
            return None
        limit = len(text) if end < 0 else end
        at = text.find(TOOL_CALL, 0, limit)
        while at >= 0:
            after = text[at + len(TOOL_CALL):].lstrip(_WHITESPACE)
            if after.startswith(FUNCTION):
                return at
            at = text.find(TOOL_CALL, at + 1, limit)
        return None

    def _tool_call_hold(self, text: str) -> int:
        """Characters held back because they may be a ``<tool_call><function`` still arriving."""
        if not self.tool_call_ends_reasoning:
            return 0
        at = text.find(TOOL_CALL)
        while at >= 0:
            after = text[at + len(TOOL_CALL):].lstrip(_WHITESPACE)
            if FUNCTION.startswith(after):  # only whitespace, or a prefix of "<function", so far
                return len(text) - at
            at = text.find(TOOL_CALL, at + 1)
        return held_back(text, TOOL_CALL)


def _drop_start(reasoning: str) -> str:
    return reasoning.replace(START, "", 1)
