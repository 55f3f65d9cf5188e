"""Monotonic scheduler counters; gauges are read from the live state when asked."""

from __future__ import annotations

COUNTERS = (
    "num_preemptions_recompute",
    "num_preemptions_swap",
    "num_blocks_swapped_out",
    "num_blocks_swapped_in",
    "num_blocks_copied",
    "num_blocks_zeroed",
    "prefix_cache_queries",  # tokens looked up
    "prefix_cache_hits",  # tokens found
    "prompt_tokens",  # prompt tokens of admitted requests, counted once per request
    "generation_tokens",  # sampled tokens accepted
    "recomputed_tokens",  # tokens computed again after a recompute-preemption
    "num_finished",  # requests (not samples) that ended, for any reason
)


class SchedulerCounters:
    __slots__ = COUNTERS

    def __init__(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}
