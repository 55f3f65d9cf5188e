"""Each constrained sequence's grammar state, and the step's bitmask of allowed tokens.

The scheduler and output processor call only what is here, and only for sequences that
carry a ``SequenceGrammar``; no other module touches xgrammar. The matcher lives on the
Sequence, so preemption keeps it: a swapped sequence resumes where it was, and a recomputed
one recomputes KV for tokens the matcher has already accepted. Each of an n > 1 request's
samples gets its own matcher when the parent forks (the parent only computes the prompt).

A grammar may start partway through the output: after its ``start_after`` tokens (a reasoning
parser's end tag; vLLM applies the grammar only after the thinking). Until the output has
generated them in a row, the sequence gets no mask row and its tokens are not fed to the matcher;
the token that completes them is the last free one. It is still handled as a constrained
sequence meanwhile (no steady decode, no step ahead, no proposals): the simplest correct choice.

A constrained sequence is never a steady decode (running.py) and never samples twice without the
scheduler knowing its previous token: its mask depends on that token (``Scheduler.can_schedule_ahead``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np

from pagedserve.protocol.messages import GrammarBitmask
from pagedserve.scheduler_proc.utf8_guard import Utf8Guard

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Sequence


@dataclass(frozen=True, slots=True)
class ServedGrammar:
    """What the grammar cache hands out: xgrammar's compiled grammar and its tokenizer's guard."""

    compiled: Any  # xgrammar.CompiledGrammar
    utf8: Utf8Guard


class RequestGrammar:
    """A request's compiled grammar and stop tokens: makes one matcher per sampling sequence."""

    __slots__ = ("compiled", "utf8", "stop_token_ids", "start_after")

    def __init__(self, served: ServedGrammar, stop_token_ids: frozenset[int], start_after: Iterable[int] = ()):
        self.compiled = served.compiled
        self.utf8 = served.utf8
        self.stop_token_ids = sorted(stop_token_ids)
        self.start_after = tuple(start_after)

    def new_matcher(self) -> "SequenceGrammar":
        return SequenceGrammar(self)


class SequenceGrammar:
    """One sequence's position in its grammar, advanced by each token it samples."""

    __slots__ = ("matcher", "waiting_for", "_recent", "_utf8", "_previous", "dead_end")

    def __init__(self, grammar: RequestGrammar):
        import xgrammar

        self.waiting_for = grammar.start_after  # () once the grammar has started
        self._recent: list[int] = []  # the last len(waiting_for) tokens while waiting
        self._utf8 = grammar.utf8
        self._previous: Optional[int] = None  # the output's last token, for the UTF-8 guard
        self.dead_end = False  # the last mask allowed no token (utf8_guard.py removed all xgrammar allowed)

        if grammar.stop_token_ids:  # the request's own stop tokens end the grammar
            self.matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=grammar.stop_token_ids)
        else:  # ignore_eos and no stop ids: the grammar ends when it is complete, no stop token allowed
            # (None, not []: xgrammar 0.2.8 refuses an empty override, which crashed the scheduler)
            self.matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=None,
                                                   terminate_without_stop_token=True)

    @property
    def started(self) -> bool:
        return not self.waiting_for

    def observe(self, token: int) -> None:
        """A token sampled before the grammar started: it starts after the one that completes
        ``waiting_for``."""
        self._previous = token
        self._recent.append(token)
        if len(self._recent) > len(self.waiting_for):
            del self._recent[0]
        if tuple(self._recent) == self.waiting_for:
            self.waiting_for, self._recent = (), []

    def accept(self, token: int) -> bool:
        self._previous = token
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self._utf8.narrow(bitmask, row, self._previous)  # what xgrammar lets through (utf8_guard.py)
        self.dead_end = not bitmask[row].any()


def step_bitmask(seqs: list["Sequence"], words_per_row: int) -> Optional[GrammarBitmask]:
    """The rows of the constrained sequences among ``seqs`` (those that sample this step), or
    None when there are none."""
    constrained = [seq for seq in seqs if seq.grammar is not None and seq.grammar.started]
    if not constrained:
        return None
    rows = np.empty((len(constrained), words_per_row), dtype=np.int32)
    for row, seq in enumerate(constrained):
        seq.grammar.fill(rows, row)
    return GrammarBitmask([seq.seq_id for seq in constrained], words_per_row, rows.astype("<i4", copy=False).tobytes())


def grammar_finish(seq: "Sequence", token: int
                   ) -> tuple[Optional[str], Optional[int], Optional[str], Optional[str]]:
    """(finish reason, stop token, error, error kind) after ``seq`` sampled ``token`` and no stop
    rule ended it.

    The grammar's end is the sequence's end ("stop"), even before min_tokens: no token can
    follow it. A token the grammar refuses means the mask was not applied (an engine error), or
    that the mask allowed nothing: a grammar that asks for what no UTF-8 text holds (a surrogate
    code point, one past U+10FFFF) at a point the frontend's check cannot see, the request's fault.
    """
    grammar = seq.grammar
    if not grammar.started:
        grammar.observe(token)
        return None, None, None, None
    if not grammar.accept(token):
        if grammar.dead_end:
            return "error", None, ("structured_outputs: the grammar allows no valid UTF-8 text here (does it ask "
                                   "for a surrogate code point?)"), "invalid_request"
        return "error", None, (f"the sampled token {token} does not fit the request's grammar "
                               f"(its mask was not applied)"), "engine"
    if grammar.terminated:
        return "stop", (token if token in seq.stop_token_ids else None), None, None
    return None, None, None, None
