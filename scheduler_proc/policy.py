"""Which waiting sequence starts next and which running one gives way: the scheduling policy.

The scheduler asks these two questions and applies the answers; everything else (budgets,
blocks, swap or recompute) is the same under every policy. A policy only reads the queues.

First come, first served (the default, and the seed workloads' rule): the oldest waiting
sequence is admitted first and nothing overtakes it; under memory pressure the newest running
sequence is preempted, so the oldest is never starved (shared/seeds 001).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Queue

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Sequence
    from pagedserve.scheduler_proc.running import RunningSequences


class FcfsPolicy:
    def next_waiting(self, waiting: Queue["Sequence"]) -> "Sequence":
        """The waiting sequence to try next (``waiting`` is not empty; arrival order, recompute-
        preempted ones among them by their own arrival)."""
        return waiting[0]

    def victim(self, running: "RunningSequences") -> "Sequence":
        """The running sequence to preempt when blocks run out (``running`` is not empty): the
        one asking for blocks, or one the step has not scheduled yet (the running loop goes
        oldest first, so the newest qualifies)."""
        return running.newest()
