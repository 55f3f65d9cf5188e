"""How many of a choice's output tokens were thinking: ``reasoning_tokens`` in chat's
``usage.completion_tokens_details`` and Responses' ``usage.output_tokens_details``.

The count is the tokens up to and including the one that completes the end of the thinking
(``</think>``, or for qwen3 the token holding the last character before ``<tool_call><function``),
a ``<think>`` the model wrote included; all of them when the thinking never ended. So it is
exactly the output that is not content, and it agrees with ``reasoning_content`` because it is
read from the same split of the same text (think_tags.py), not from a second rule on token ids:
a tag the model wrote in several tokens, or a stop string, cannot make the two disagree.

The split is on characters and the count on tokens: the smallest prefix of the choice's tokens
whose decoded text reaches the end of the thinking. Where the tokens hold the end tag's own ids
and the prefix through them decodes to exactly the thinking, that prefix is it (one decode of
the thinking); otherwise bisection finds it (a dozen or more decodes: bench/log/2026-11-26.md,
"Reasoning token counts (issue 35)"). Either runs once per choice, when it finishes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagedserve.client.detokenizer import Decodes
from pagedserve.frontend_proc.reasoning.think_tags import ThinkTagParser


def reasoning_token_count(parser: ThinkTagParser, text: str, token_ids: list[int], decoder: Decodes,
                          end_ids: Sequence[int] = ()) -> int:
    """``text``: the choice's whole output text; ``token_ids``: the tokens rendered into it;
    ``end_ids``: the end tag's encoding."""
    end = parser.content_start(text)
    if end is None:
        return len(token_ids)
    through_tag = _through_first(token_ids, end_ids)
    if through_tag is not None and len(decoder.decode(token_ids[:through_tag])) == end:
        return through_tag  # its last token (a piece of the tag) has text, so no shorter prefix reaches end
    low, high = 0, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(decoder.decode(token_ids[:middle])) >= end:
            high = middle
        else:
            low = middle + 1
    return low


def _through_first(token_ids: list[int], pattern: Sequence[int]) -> Optional[int]:
    """The length of the shortest prefix of ``token_ids`` that ends with ``pattern``."""
    if not pattern:
        return None
    first = pattern[0]
    at = -1
    while True:
        try:
            at = token_ids.index(first, at + 1)
        except ValueError:
            return None
        if token_ids[at:at + len(pattern)] == list(pattern):
            return at + len(pattern)
