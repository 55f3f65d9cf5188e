"""What one ``schedule()`` call collects before it becomes a ``SchedulerOutput``."""

from __future__ import annotations


class StepBatch:
    __slots__ = ("budget", "new", "cached", "sampling_new", "sampling_cached", "others",
                 "swap_out", "swap_in", "preempted")

    def __init__(self, token_budget: int):
        self.budget = token_budget  # tokens still free in this step
        self.new: list = []  # NewRequestData
        self.cached: list = []  # CachedRequestData
        # Sequences in batch order: the ones that sample this step (new first, as the
        # workers list them in StepResult) and the ones computing a non-final prefill chunk.
        self.sampling_new: list = []
        self.sampling_cached: list = []
        self.others: list = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.preempted = False
