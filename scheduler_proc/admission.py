"""Who gets onto the device: checked once on arrival, then in order at every step.

A request that could never be scheduled ends at once with an ``invalid_request`` error
whose message names the numbers, instead of waiting forever (or being silently dropped).
Swapped and waiting sequences start in the policy's order (policy.py; FCFS: swapped ones
first, then waiting ones strictly in arrival order, recompute-preempted ones at the front).

The functions here answer questions and return plain decisions; the scheduler applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.protocol.messages import AddRequest, RequestDelta
from pagedserve.protocol.priority import priority_refusal
from pagedserve.protocol.validate import InvalidField, check_fields

from pagedserve.scheduler_proc import prefix_cache
from pagedserve.scheduler_proc.block_manager import BlockManager
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.grammar_cache import compile_for
from pagedserve.scheduler_proc.lora_slots import lora_refusal
from pagedserve.scheduler_proc.request import Sequence
from pagedserve.scheduler_proc.sliding_window import blocks_behind, max_live_blocks


def usable_blocks(config: SchedulerConfig) -> int:
    """Device blocks sequences may hold: all but the null block a window reserves (block_manager.py)."""
    return config.num_gpu_blocks - (config.sliding_window > 0 or config.num_window_groups > 0)


def hybrid_live_blocks(config: SchedulerConfig) -> Optional[int]:
    """A hybrid model's bound on each local table's blocks (``max_live_blocks`` of its window), where
    a sequence's local tables stay within it: chunked prefill, whose chunks shrink to what is free;
    None where they may hold a whole prompt (or recompute) at once, or the model is not hybrid."""
    if not config.num_window_groups or not config.enable_chunked_prefill:
        return None
    return max_live_blocks(config.hybrid_window, config.block_size)


def window_bounds_blocks(config: SchedulerConfig) -> bool:
    """Whether a sequence's blocks at any one time are bounded by the window, not its length: blocks
    behind the window are freed, prompts (and recomputes) go in chunks that shrink to what is free,
    and the cache holds what a lone sequence needs at once (sliding_window.py)."""
    return (config.sliding_window > 0 and config.enable_chunked_prefill
            and usable_blocks(config) >= max_live_blocks(config.sliding_window, config.block_size))


def length_limit(config: SchedulerConfig) -> int:
    """Most tokens (prompt + outputs) one sequence may hold.

    The model's limit, and the whole device cache plus the one sampled token that is never
    computed: a lone sequence can always grow to this, so it can never deadlock itself. Where the
    window bounds a sequence's blocks, only the model's limit.
    """
    if window_bounds_blocks(config):
        return config.max_model_len
    usable, groups = usable_blocks(config), config.num_window_groups
    live = hybrid_live_blocks(config)
    if live is not None and usable - groups * live >= live:  # the local tables at their bound
        usable -= groups * live
    elif groups:  # each local table as long as the global one
        usable //= 1 + groups
    return min(config.max_model_len, usable * config.block_size + 1)


def peak_blocks(config: SchedulerConfig, num_tokens: int) -> int:
    """The most blocks a sequence holding ``num_tokens`` needs at once."""
    blocks = -(-num_tokens // config.block_size)
    if window_bounds_blocks(config):
        return min(blocks, max_live_blocks(config.sliding_window, config.block_size))
    if config.num_window_groups:  # the global table, and each local one
        live = hybrid_live_blocks(config)
        return blocks + config.num_window_groups * (blocks if live is None else min(blocks, live))
    return blocks


def rejection_reason(msg: AddRequest, config: SchedulerConfig) -> Optional[str]:
    """Why ``msg`` can never be served by this scheduler, or None if it can."""
    try:  # decoding checked a frame's ranges; a caller in process checks its own (validate.check_request)
        check_fields(msg, config.vocab_size)
    except InvalidField as exc:
        return str(exc)
    refusal = priority_refusal(config.scheduling_policy, msg.priority)  # the edges refuse it first
    if refusal is not None:
        return refusal
    sampling = msg.sampling
    num_prompt = len(msg.prompt_token_ids)
    if sampling.n > config.max_num_seqs:
        return (f"n={sampling.n} parallel samples exceed max_num_seqs={config.max_num_seqs}, "
                f"the most sequences one step can run")
    if num_prompt + (msg.pooling is None) > config.max_model_len:  # an embedding request generates nothing
        if msg.pooling is not None:
            return f"the prompt has {num_prompt} tokens, more than max_model_len={config.max_model_len}"
        return (f"the prompt has {num_prompt} tokens; with at least one generated token that exceeds "
                f"max_model_len={config.max_model_len}")
    block_size = config.block_size
    usable = usable_blocks(config)
    prompt_blocks = peak_blocks(config, num_prompt)
    if prompt_blocks > usable:
        return (f"the prompt has {num_prompt} tokens and needs {prompt_blocks} KV blocks of "
                f"{block_size} tokens, but the cache has only {usable} blocks")
    if sampling.n > 1:
        # The shared prompt[:-1] plus one block per sample for the first token each writes.
        needed = peak_blocks(config, num_prompt - 1) + sampling.n * (1 + config.num_window_groups)
        if needed > usable:
            return (f"n={sampling.n} samples of a {num_prompt}-token prompt need {needed} KV blocks of "
                    f"{block_size} tokens at once, but the cache has only {usable} blocks")
    return None


@dataclass(frozen=True, slots=True)
class NewRequestVerdict:
    """Whether a new request joins the waiting queue: ``reason`` None, with its compiled grammar
    (if any); else why not, as the error ``kind`` the frontend maps to a status."""
    reason: Optional[str] = None
    kind: str = "invalid_request"
    compiled: Any = None

    def error_deltas(self, msg: AddRequest, max_num_seqs: int) -> list[RequestDelta]:
        n = msg.sampling.n
        indices = range(n) if 1 <= n <= max_num_seqs else range(1)  # never 10**9 deltas
        return [RequestDelta(msg.request_id, i, [], "error", self.reason, self.kind,
                             len(msg.prompt_token_ids)) for i in indices]


def judge_new(msg: AddRequest, config: SchedulerConfig, in_use, grammars, num_waiting: int,
              adapters: dict) -> NewRequestVerdict:
    """Checked in order: what can never be served, an id in use, a LoRA adapter not registered
    (``adapters``, by name), a grammar that does not compile (all 400s), then load shedding (429)."""
    reason = rejection_reason(msg, config)
    if reason is None and msg.request_id in in_use:
        reason = f"request id {msg.request_id!r} is already in use"
    if reason is None:
        reason = lora_refusal(msg, config.enable_lora, adapters)
    if reason is not None:
        return NewRequestVerdict(reason)
    compiled, reason = compile_for(grammars, msg.sampling.structured_outputs)
    if reason is not None:
        return NewRequestVerdict(reason)
    reason = shedding_reason(num_waiting, config)
    if reason is not None:
        return NewRequestVerdict(reason, "overloaded")
    return NewRequestVerdict(compiled=compiled)


def shedding_reason(num_waiting: int, config: SchedulerConfig) -> Optional[str]:
    """Why a new request is refused for now (--max-waiting-requests), or None. The frontend
    sheds first from its view of the replicas' stats; this catches what that view missed."""
    limit = config.max_waiting_requests
    if limit is None or num_waiting < limit:
        return None
    return (f"the server is overloaded: {num_waiting} requests are waiting, the limit is "
            f"{limit} (--max-waiting-requests); retry later")


def should_swap(seq: Sequence, bm: BlockManager, config: SchedulerConfig) -> bool:
    """Whether a running ``seq`` leaves by swap (else by recompute)."""
    mode = config.preemption_mode  # auto: under one full block, recompute is cheaper than a move
    if mode == "recompute" or not bm.can_swap_out(seq):
        return False
    return mode == "swap" or seq.num_kv_tokens >= config.block_size


def chunk_size(remaining: int, budget: int, chunked_prefill: bool) -> int:
    """Tokens of ``remaining`` a sequence computes this step, with ``budget`` tokens left."""
    if remaining <= budget:
        return remaining
    return budget if chunked_prefill else 0


def seats_needed(seq: Sequence) -> int:
    """A parent holds a seat for each child it forks into."""
    return seq.request.sampling.n if seq.is_parent else 1


def tokens_to_resume(seq: Sequence, bm: BlockManager, budget: int, chunked_prefill: bool) -> int:
    """Tokens a swapped ``seq`` computes if it comes back this step; 0: it does not fit."""
    num_tokens = chunk_size(seq.target_len - seq.num_kv_tokens, budget, chunked_prefill)
    if num_tokens > 0 and bm.frees_behind_window and chunked_prefill:  # a window bounds (local) tables:
        num_tokens = min(num_tokens, bm.swap_in_room(seq))  # a chunk that fits
    return num_tokens if num_tokens > 0 and bm.can_swap_in(seq, num_tokens) else 0


def admission_reserve(num_running: int) -> int:
    """Free blocks a new admission must leave for the running sequences to grow into.

    One block per running sequence: room for every one of them to grow for the next
    ``block_size`` tokens. Admitting into the last free blocks only to preempt the
    newcomer a few steps later (and again, and again) is the thrash that FCFS preemption
    alone cannot stop. With nothing running the reserve is 0, so the head of the queue,
    which fits the whole cache, can always be admitted eventually.
    """
    return num_running


class Admission:
    """How a waiting sequence starts: its prefix-cache hits and the blocks and tokens of its first step."""

    __slots__ = ("seq", "hits", "keys", "looked_up", "num_computed", "num_blocks", "num_tokens", "forks_now",
                 "num_behind", "window_hits", "window_behind")

    def __init__(self, seq: Sequence, hits: list[int], keys: list, looked_up: bool, num_computed: int,
                 num_blocks: int, num_tokens: int, forks_now: bool, num_behind: int = 0,
                 window_hits: tuple[list[int], ...] = (), window_behind: int = 0):
        self.seq = seq
        self.hits = hits
        self.keys = keys
        self.looked_up = looked_up  # counted as a prefix-cache query
        self.num_computed = num_computed  # tokens the hits cover
        self.num_blocks = num_blocks
        self.num_tokens = num_tokens  # to compute this step (0 when the parent forks at once)
        self.forks_now = forks_now  # a parent whose prompt[:-1] is all cached: its children sample now
        self.num_behind = num_behind  # leading hits behind the window: counted, never taken
        self.window_hits = window_hits  # a hybrid model's local groups' hits (prefix_cache.window_hits)
        self.window_behind = window_behind  # their leading entries behind the local window


def window_growth(config: SchedulerConfig, running) -> int:
    """Blocks the ``running`` sequences may still take before each holds its window's worth (a
    parent: one window per sample), where the window bounds them; 0 otherwise. A scan of the
    running set, paid only when a sequence is about to be admitted."""
    if not window_bounds_blocks(config):
        return 0
    growth = 0
    for seq in running:
        samples = seq.request.sampling.n if seq.is_parent else 1
        growth += max(0, samples * peak_blocks(config, seq.max_len) - (len(seq.block_ids) - seq.num_freed_blocks))
    return growth


def plan_admission(seq: Sequence, bm: BlockManager, config: SchedulerConfig, budget: int,
                   num_running: int, growth: int = 0) -> Optional[Admission]:
    """How ``seq`` (waiting, with a seat free) starts this step, or None if it does not fit.
    ``growth``: ``window_growth`` of the running sequences, kept free for them."""
    request = seq.request
    block_size = config.block_size
    # A cached block computes nothing, so prompt logprobs need the whole prompt computed (as vLLM),
    # and so does mean pooling; last-token pooling reads only the last token, never a hit (pooling.py).
    lookup = (config.enable_prefix_caching and request.sampling.prompt_logprobs is None
              and request.pooling != "mean")
    hits, keys = prefix_cache.lookup(bm.device, seq, block_size) if lookup else ([], [])
    window_hits: tuple[list[int], ...] = ()
    window_behind = 0
    groups = bm.num_window_groups
    if hits and groups:
        num_hits, window_hits, window_behind = prefix_cache.window_hits(bm.device, hits, keys, groups,
                                                                        bm.hybrid_window, block_size)
        hits, keys = hits[:num_hits], keys[:num_hits]
    computed = len(hits) * block_size
    remaining = seq.target_len - computed
    num_tokens = chunk_size(remaining, budget, config.enable_chunked_prefill)
    if num_tokens <= 0 and remaining > 0:
        return None
    forks_now = seq.is_parent and remaining == 0
    num_blocks = bm.blocks_for(computed + num_tokens)
    children_blocks = request.sampling.n * bm.num_tables if forks_now else 0  # each child's first token's block(s)
    behind = min(blocks_behind(computed, bm.window, block_size), len(hits)) if bm.window else 0
    if num_tokens > 0 and window_bounds_blocks(config):  # a prompt longer than the cache: chunks that fit
        ref_counts = bm.device.ref_counts
        revived = sum(1 for block in hits[behind:] if ref_counts[block] == 0)
        spare = bm.device.num_free - revived - growth
        num_tokens = min(num_tokens, spare * block_size)
        if num_tokens <= 0:
            return None
        num_blocks = bm.blocks_for(computed + num_tokens)
    if num_tokens > 0 and num_running == 0 and hybrid_live_blocks(config) is not None:
        # alone, a chunk every table has room for: a prompt (or recompute) whose local tables would not
        # fit at once still starts; beside others it waits for room, as a one-table model's does (a
        # recompute squeezed into the last blocks would preempt the next newest at its next chunk)
        ref_counts = bm.device.ref_counts
        revived = sum(1 for block in hits if ref_counts[block] == 0)
        revived += sum(1 for group_hits in window_hits for block in group_hits if ref_counts[block] == 0)
        spare = bm.device.num_free - revived
        num_tokens = min(num_tokens, spare // bm.num_tables * block_size)
        if num_tokens <= 0:
            return None
        num_blocks = bm.blocks_for(computed + num_tokens)
    if window_bounds_blocks(config):  # what each will hold is known and small: room for all of it now,
        # so that no sequence's growth to its window preempts another (FCFS's thrash without it), in
        # place of the one block per running sequence
        samples = request.sampling.n if seq.is_parent else 1
        taken = num_blocks - behind + children_blocks
        reserve = growth + max(0, samples * peak_blocks(config, seq.max_len) - taken)
        # n windows that exceed the cache: its samples take turns, but alone it always starts
        reserve = min(reserve, max(0, usable_blocks(config) - taken))
    else:
        reserve = admission_reserve(num_running) * bm.num_tables  # a block boundary asks one block per table
    taken = num_blocks - behind
    held_hits = hits[behind:]
    if groups:  # the local tables: their window's hits, then fresh blocks
        taken += groups * (num_blocks - window_behind)
        held_hits = held_hits + [block for group_hits in window_hits for block in group_hits]
    if not bm.can_allocate(held_hits, taken + children_blocks + reserve):
        return None
    return Admission(seq, hits, keys, lookup, computed, num_blocks, num_tokens, forks_now, behind, window_hits,
                     window_behind)
