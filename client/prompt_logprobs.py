"""A request's prompt logprobs, per prompt token, as vLLM shapes them for HTTP and offline alike.

None for the first prompt token (nothing scores it), then per token a table holding the prompt
token and the k most likely alternatives; an alternative equal to the prompt token appears once.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, TypeVar

from pagedserve.protocol.messages import PromptLogprobs

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def prompt_logprob_tables(prompt: list[int], scored: PromptLogprobs, k: int,
                          entry: Callable[[int, float, int], V],
                          key: Callable[[int], K] = int) -> list[Optional[dict[K, V]]]:
    """``entry(token, logprob, rank)`` is one table value, ``key(token)`` its key."""
    tables: list[Optional[dict[K, V]]] = [None]
    for row in scored.per_token(prompt, k):
        table: dict[K, V] = {}
        for token, logprob, rank in row:  # the prompt token first
            if key(token) not in table:
                table[key(token)] = entry(token, logprob, rank)
        tables.append(table)
    return tables
