"""Monotonic scheduler counters; gauges are read from the live state when asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.scheduler import Scheduler

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
    "structured_output_requests",  # admitted requests whose output a grammar constrains
    "structured_output_mask_time_s",  # seconds spent filling grammar bitmasks (a float)
)


class SchedulerCounters:
    __slots__ = COUNTERS

    def __init__(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0.0 if name.endswith("_s") else 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}


def snapshot(sched: "Scheduler") -> dict:
    """Gauges of the live state plus every counter: what SchedulerStats and /metrics carry."""
    device, host = sched.bm.device, sched.bm.host
    return {
        "num_running": sched.num_running,
        "num_waiting": len(sched.waiting),
        "num_swapped": len(sched.swapped),
        "num_gpu_blocks": device.num_blocks,
        "num_free_gpu_blocks": device.num_free,
        "num_cpu_blocks": host.num_blocks,
        "num_free_cpu_blocks": host.num_free,
        "kv_cache_usage": device.num_used / device.num_blocks,
        "cache_events_sent": sched.cache_events.num_sent,
        **sched.counters.as_dict(),
    }
