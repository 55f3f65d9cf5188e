"""Prompt logprobs in the HTTP responses, as vLLM renders them.

``prompt_logprobs`` (vLLM's extra field): per prompt token, None for the first, then a dict
token id -> {logprob, rank, decoded_token} holding the prompt token and the k best
alternatives. ``echo`` with ``logprobs`` on /v1/completions: the prompt's tokens lead the
choice's ``logprobs`` object, the first with a null logprob and null alternatives.
"""

from __future__ import annotations

from typing import Callable, Optional

from pagedserve.client.prompt_logprobs import prompt_logprob_tables
from pagedserve.frontend_proc.response_format import LogprobEntries
from pagedserve.protocol.messages import PromptLogprobs


def prompt_logprob_dicts(prompt: list[int], scored: PromptLogprobs, k: int,
                         token_text: Callable[[int], str]) -> list[Optional[dict[str, dict]]]:
    return prompt_logprob_tables(
        prompt, scored, k, lambda token, logprob, rank: {"logprob": logprob, "rank": rank,
                                                         "decoded_token": token_text(token)}, key=str)


def echo_entries(prompt: list[int], scored: PromptLogprobs, k: int,
                 token_text: Callable[[int], str], hidden: frozenset[int] = frozenset()) -> LogprobEntries:
    """``hidden``: the tokens the echoed text leaves out (special ones, decoded skipping them)."""
    entries: LogprobEntries = [(token_text(prompt[0]), None, None, prompt[0] not in hidden)]
    for (token, logprob, _), *alternatives in scored.per_token(prompt, k):
        entries.append((token_text(token), logprob, [(token_text(t), lp) for t, lp, _ in alternatives],
                        token not in hidden))
    return entries
