"""Monotonic scheduler counters; gauges are read from the live state when asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.protocol.priority import MAX_TENANT_KEYS, OTHER_TENANTS, POLICIES_WITH_PRIORITY

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
    "num_queue_time_expired",  # requests ended without a first token past their limit (deadlines.py)
    "num_deadline_expired",  # requests ended at their deadline_s with the tokens so far
    "num_requests_shed",  # refused here by --max-waiting-requests
)
# Counters per priority and per tenant, summed when a request ends (not per token: free at any
# batch size). Tenants past this many share one key, so a flood of names cannot grow the stats.
BY_CLASS = ("generation_tokens_by_priority", "generation_tokens_by_tenant",
            "deadline_misses_by_priority", "deadline_misses_by_tenant", "generation_tokens_by_lora")


class SchedulerCounters:
    __slots__ = COUNTERS + BY_CLASS

    def __init__(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0.0 if name.endswith("_s") else 0)
        for name in BY_CLASS:
            setattr(self, name, {})

    def count_closed(self, request) -> None:
        """``request`` ended (its sequences still attached): its generated tokens by class."""
        tokens = sum(len(seq.token_ids) - seq.num_prompt_tokens for seq in request.sequences if not seq.is_parent)
        if tokens:
            _add(self.generation_tokens_by_priority, request.priority, tokens)
            _add(self.generation_tokens_by_tenant, _tenant_key(self.generation_tokens_by_tenant, request), tokens)
            if request.lora is not None:  # runtime loading could name adapters without end: bounded like tenants
                by_lora = self.generation_tokens_by_lora
                name = request.lora.name
                _add(by_lora, name if name in by_lora or len(by_lora) < MAX_TENANT_KEYS else OTHER_TENANTS, tokens)

    def count_miss(self, request, missed_first_token: bool) -> None:
        if missed_first_token:
            self.num_queue_time_expired += 1
        else:
            self.num_deadline_expired += 1
        _add(self.deadline_misses_by_priority, request.priority, 1)
        _add(self.deadline_misses_by_tenant, _tenant_key(self.deadline_misses_by_tenant, request), 1)

    def count_admission(self, plan, first: bool) -> None:
        """``plan`` (admission.Admission) was applied; ``first``: the sequence's first admission."""
        if plan.looked_up:
            self.prefix_cache_queries += len(plan.seq.token_ids)
            self.prefix_cache_hits += plan.num_computed
        if first:
            self.prompt_tokens += plan.seq.request.num_prompt_tokens

    def count_step(self, batch, num_zeroed: int, num_copied: int) -> None:
        """A scheduled step's cache work (``batch``: its StepPlan)."""
        self.recomputed_tokens += batch.num_recomputed
        self.num_blocks_zeroed += num_zeroed
        self.num_blocks_copied += num_copied
        self.num_blocks_swapped_out += len(batch.swap_out)
        self.num_blocks_swapped_in += len(batch.swap_in)

    def as_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in COUNTERS},
                **{name: dict(getattr(self, name)) for name in BY_CLASS}}


def snapshot(sched: "Scheduler") -> dict:
    """Gauges of the live state plus every counter: what SchedulerStats and /metrics carry."""
    device, host = sched.bm.device, sched.bm.host
    by_priority = sched.policy.name in POLICIES_WITH_PRIORITY  # under the others every priority is 0
    priority = lambda seq: seq.request.priority  # noqa: E731
    tenant = lambda seq: seq.request.tenant  # noqa: E731
    running = list(sched.running)
    return {
        "scheduling_policy": sched.policy.name,
        "num_waiting_by_priority": _count(sched.waiting, priority) if by_priority else {},
        "num_running_by_priority": _count(running, priority) if by_priority else {},
        "num_waiting_by_tenant": _count(sched.waiting, tenant),
        "num_running_by_tenant": _count(running, tenant),
        "tenant_service": sched.policy.service(),
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_swapped": len(sched.swapped),
        "num_gpu_blocks": device.num_blocks,
        "num_free_gpu_blocks": device.num_free,
        "num_cpu_blocks": host.num_blocks,
        "num_free_cpu_blocks": host.num_free,
        "kv_cache_usage": device.num_used / device.num_blocks,
        "cache_events_sent": sched.cache_events.num_sent,
        **_lora_gauges(sched, running),
        **sched.counters.as_dict(),
        **(sched.speculator.stats() if sched.speculator is not None else {}),
    }


def _lora_gauges(sched: "Scheduler", running: list) -> dict:
    """vLLM's ``vllm:lora_requests_info`` labels: the adapters with a running / waiting sequence."""
    if sched.lora is None:
        return {}
    def names(seqs) -> list[str]:
        return sorted({seq.request.lora.name for seq in seqs if seq.request.lora is not None})

    return {"max_lora": sched.config.max_loras, "running_lora_adapters": names(running),
            "waiting_lora_adapters": names(sched.waiting)}


def _count(seqs, key) -> dict:
    counts: dict = {}
    for seq in seqs:
        value = key(seq)
        counts[value] = counts.get(value, 0) + 1
    return counts


def _add(counts: dict, key, value: int) -> None:
    counts[key] = counts.get(key, 0) + value


def _tenant_key(counts: dict, request) -> str:
    tenant = request.tenant
    return tenant if tenant in counts or len(counts) < MAX_TENANT_KEYS else OTHER_TENANTS
