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

    def count_step(self, batch, num_zeroed: int, num_copied: int) -> None:
        """A scheduled step's cache work (``batch``: its StepPlan)."""
        self.recomputed_tokens += batch.num_recomputed
        self.num_blocks_zeroed += num_zeroed
        self.num_blocks_copied += num_copied
        self.num_blocks_swapped_out += len(batch.swap_out)
        self.num_blocks_swapped_in += len(batch.swap_in)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}


def snapshot(sched: "Scheduler") -> dict:
    """Gauges of the live state plus every counter: what SchedulerStats and /metrics carry."""
    device, host = sched.bm.device, sched.bm.host
    by_priority = sched.policy.name == "priority"  # under fcfs every priority is 0
    priority = lambda seq: seq.request.priority  # noqa: E731
    return {
        "scheduling_policy": sched.policy.name,
        "num_waiting_by_priority": _count(sched.waiting, priority) if by_priority else {},
        "num_running_by_priority": _count(sched.running.unsynced(), priority) if by_priority else {},
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
        **(sched.speculator.stats() if sched.speculator is not None else {}),
    }


def _count(seqs, key) -> dict:
    counts: dict = {}
    for seq in seqs:
        value = key(seq)
        counts[value] = counts.get(value, 0) + 1
    return counts
