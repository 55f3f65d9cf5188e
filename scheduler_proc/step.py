"""What one ``schedule()`` call collects, and what one ``update_from_output()`` returns."""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.messages import RequestDelta, iter_deltas


class SchedulerStateError(RuntimeError):
    """The engine loop called the scheduler out of order (e.g. two schedules without an update)."""


class StepPlan:
    __slots__ = ("budget", "new", "cached", "sampling_new", "sampling_cached", "others",
                 "swap_out", "swap_in", "preempted")

    def __init__(self, token_budget: int):
        self.budget = token_budget  # tokens still free in this step
        self.new: list = []  # NewRequestData
        self.cached: list = []  # CachedRequestData
        # Sequences in batch order: the ones that sample this step (new first, as the
        # workers list them in StepResult) and the ones computing a non-final prefill chunk.
        # The decode lane's sequences sample after all of these.
        self.sampling_new: list = []
        self.sampling_cached: list = []
        self.others: list = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.preempted = False


class StepOutputs:
    """One step's news for the frontend: plain next tokens as parallel lists, the rest as deltas.

    The fields are those of ``RequestOutputs``; iterating gives every delta as a
    ``RequestDelta``, token lists first, which is the order a receiver applies them in.
    """

    __slots__ = ("deltas", "token_request_ids", "token_indices", "token_ids")

    def __init__(self, deltas: list[RequestDelta], token_request_ids: Optional[list[str]] = None,
                 token_indices: Optional[list[int]] = None, token_ids: Optional[list[int]] = None):
        self.deltas = deltas
        self.token_request_ids = [] if token_request_ids is None else token_request_ids
        self.token_indices = [] if token_indices is None else token_indices
        self.token_ids = [] if token_ids is None else token_ids

    def __bool__(self) -> bool:
        return bool(self.deltas or self.token_ids)

    def __iter__(self):
        return iter_deltas(self)

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"
