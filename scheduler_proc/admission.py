"""Who gets onto the device: checked once on arrival, then in order at every step.

A request that could never be scheduled ends at once with an ``invalid_request`` error
whose message names the numbers, instead of waiting forever (or being silently dropped).
Swapped sequences come back before any waiting one is admitted, and waiting ones are
admitted strictly in arrival order (recompute-preempted ones sit at the front).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pagedserve.protocol.messages import AddRequest
from pagedserve.protocol.validate import InvalidField, check_request

from pagedserve.scheduler_proc import output_processor, prefix_cache
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.step import StepPlan

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.scheduler import Scheduler


def length_limit(config: SchedulerConfig) -> int:
    """Most tokens (prompt + outputs) one sequence may hold.

    The model's limit, and the whole device cache plus the one sampled token that is never
    computed: a lone sequence can always grow to this, so it can never deadlock itself.
    """
    return min(config.max_model_len, config.num_gpu_blocks * config.block_size + 1)


def rejection_reason(msg: AddRequest, config: SchedulerConfig) -> Optional[str]:
    """Why ``msg`` can never be served by this scheduler, or None if it can."""
    try:  # decoding checked the ranges already; this covers in-process callers and the vocabulary
        check_request(msg, config.vocab_size)  # so: a prompt token, max_tokens >= 1, n >= 1, ...
    except InvalidField as exc:
        return str(exc)
    sampling = msg.sampling
    num_prompt = len(msg.prompt_token_ids)
    if sampling.n > config.max_num_seqs:
        return (f"n={sampling.n} parallel samples exceed max_num_seqs={config.max_num_seqs}, "
                f"the most sequences one step can run")
    if num_prompt + 1 > config.max_model_len:
        return (f"the prompt has {num_prompt} tokens; with at least one generated token that exceeds "
                f"max_model_len={config.max_model_len}")
    block_size = config.block_size
    prompt_blocks = -(-num_prompt // block_size)
    if prompt_blocks > config.num_gpu_blocks:
        return (f"the prompt has {num_prompt} tokens and needs {prompt_blocks} KV blocks of "
                f"{block_size} tokens, but the cache has only {config.num_gpu_blocks} blocks")
    if sampling.n > 1:
        # The shared prompt[:-1] plus one block per sample for the first token each writes.
        needed = -(-(num_prompt - 1) // block_size) + sampling.n
        if needed > config.num_gpu_blocks:
            return (f"n={sampling.n} samples of a {num_prompt}-token prompt need {needed} KV blocks of "
                    f"{block_size} tokens at once, but the cache has only {config.num_gpu_blocks} blocks")
    return None


def resume_swapped(sched: "Scheduler", batch: StepPlan) -> None:
    """Swapped sequences come back oldest first, until one does not fit."""
    swapped = sched.swapped
    while swapped:
        seq = swapped[0]
        seats = seq.request.sampling.n if seq.is_parent else 1
        if sched.seats_free() < seats:
            return
        num_tokens = sched.chunk_size(seq.target_len - seq.num_kv_tokens, batch.budget)
        if num_tokens <= 0 or not sched.bm.can_swap_in(seq, num_tokens):
            return
        swapped.pop(0)
        batch.swap_in.extend(sched.bm.swap_in(seq))
        if sched.config.enable_prefix_caching:
            prefix_cache.republish(sched.bm.device, seq)
        sched.bm.append_slots(seq, num_tokens)
        sched.enter_running(seq)
        sched.emit(seq, seq.num_kv_tokens, num_tokens, batch)


def admission_reserve(sched: "Scheduler") -> int:
    """Free blocks a new admission must leave for the running sequences to grow into.

    One block per running sequence: room for every one of them to grow for the next
    ``block_size`` tokens. Admitting into the last free blocks only to preempt the
    newcomer a few steps later (and again, and again) is the thrash that FCFS preemption
    alone cannot stop. With nothing running the reserve is 0, so the head of the queue,
    which fits the whole cache, can always be admitted eventually.
    """
    return len(sched.running) + sched.lane.n


def admit_waiting(sched: "Scheduler", batch: StepPlan) -> None:
    """Waiting sequences start strictly in arrival order; the first that does not fit stops the rest."""
    waiting = sched.waiting
    bm = sched.bm
    bs = sched.block_size
    prefix = sched.config.enable_prefix_caching
    while waiting and batch.budget > 0:
        seq = waiting[0]
        request = seq.request
        n = request.sampling.n
        if sched.seats_free() < (n if seq.is_parent else 1):
            return
        # A cached block computes nothing, so prompt logprobs need the whole prompt computed (as vLLM).
        lookup = prefix and request.sampling.prompt_logprobs is None
        hits, keys = prefix_cache.lookup(bm.device, seq, bs) if lookup else ([], [])
        computed = len(hits) * bs
        remaining = seq.target_len - computed
        num_tokens = sched.chunk_size(remaining, batch.budget)
        if num_tokens <= 0 and remaining > 0:
            return
        forks_now = seq.is_parent and remaining == 0  # the cache holds all of prompt[:-1]
        num_blocks = bm.blocks_for(computed + num_tokens)
        children_blocks = n if forks_now else 0  # each child's first token needs a block
        if not bm.can_allocate(hits, num_blocks + children_blocks + admission_reserve(sched)):
            return
        waiting.popleft()
        if lookup:
            sched.counters.prefix_cache_queries += len(seq.token_ids)
            sched.counters.prefix_cache_hits += computed
        first_admission = seq.num_preemptions == 0
        if first_admission:
            sched.counters.prompt_tokens += request.num_prompt_tokens
            request.num_cached_tokens = computed
        seq.num_cached_tokens = request.num_cached_tokens
        bm.allocate(seq, hits, num_blocks)
        seq.block_keys = keys
        seq.num_kv_tokens = computed
        sched.enter_running(seq)
        if num_tokens > 0:
            sched.emit(seq, computed, num_tokens, batch)
        elif forks_now:  # sample right away
            for child in output_processor.fork(sched, seq):
                if batch.budget > 0 and bm.can_append_slots(child, 1):
                    bm.append_slots(child, 1)
                    sched.emit(child, child.num_kv_tokens, 1, batch)
