"""Speculative decoding's worker half: score every proposed position, accept a prefix.

An entry with proposals d_0 .. d_{k-1} (``SchedulerOutput.spec_token_ids``) computes its
token and the k proposals in one forward, as a chunk after its cached context, and the
sampler draws at each of the k + 1 positions as if the entry had reached it without
speculation: row j sees the context plus d_0 .. d_{j-1} (for the penalties) and draws with
the noise of output index ``num_output_tokens + j`` (sampler.py). Proposal j is accepted
while row j drew exactly d_j; the first row that drew something else, or row k when all were
accepted, gives the entry's one new sampled token.

Why that is rejection sampling: the proposer's distribution q is a point mass on d_j, so
the rule "accept d_j with probability min(1, p(d_j) / q(d_j)) = p(d_j), else draw from
max(0, p - q) normalised, which is p without d_j" is exactly "draw t from p; accept when
t = d_j, else emit t" (a draw from p conditioned on t != d_j is p without d_j, normalised).
Under greedy it is exact match. And because each row's noise is the one the same output index
gets without speculation, a seeded request's tokens are the same with or without it.
"""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.step_state import HeldRequest


class DraftRow:
    """Row ``j`` of an entry with proposals: what the sampler reads of a request, at that position."""

    __slots__ = ("owner", "j", "context", "req_id", "sampling", "seed", "num_prompt_tokens", "num_output_tokens",
                 "last_sampled", "min_tokens_stops")

    def __init__(self, owner: HeldRequest, j: int, context: list[int]):
        self.owner = owner
        self.j = j
        self.context = context  # the owner's tokens followed by its first j proposals
        self.req_id = owner.req_id
        self.sampling = owner.sampling
        self.seed = owner.seed
        self.num_prompt_tokens = owner.num_prompt_tokens
        self.num_output_tokens = owner.num_output_tokens + j
        self.last_sampled: Optional[int] = None
        self.min_tokens_stops = owner.min_tokens_stops

    @property
    def token_ids(self) -> list[int]:
        return self.context


def draft_rows(req: HeldRequest, drafts: list[int]) -> list[DraftRow]:
    """The k + 1 sampled rows of ``req``; contexts are built only when a penalty reads them."""
    s = req.sampling
    penalized = s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
    tokens = req.token_ids
    return [DraftRow(req, j, tokens + drafts[:j] if penalized and j else tokens) for j in range(len(drafts) + 1)]


def accept(sampled_rows: list, token_ids: list[int], drafts: dict[str, list[int]]) -> tuple[list, list[int], list[int],
                                                                                            dict[str, int]]:
    """Rows' samples → one (request, token) per entry, the rows kept, and accepted counts by id.

    Returns the entries in batch order, their tokens, the index of the row each token came from
    (for logprobs) and ``num_accepted_tokens`` (for ``step_state.note_accepted``).
    """
    entries, tokens, rows, accepted = [], [], [], {}
    i, n = 0, len(sampled_rows)
    while i < n:
        row = sampled_rows[i]
        if not isinstance(row, DraftRow):
            entries.append(row)
            tokens.append(token_ids[i])
            rows.append(i)
            i += 1
            continue
        owner = row.owner
        proposed = drafts[owner.req_id]
        a = 0
        while a < len(proposed) and token_ids[i + a] == proposed[a]:
            a += 1
        entries.append(owner)
        tokens.append(token_ids[i + a])
        rows.append(i + a)
        accepted[owner.req_id] = a
        i += len(proposed) + 1
    return entries, tokens, rows, accepted
