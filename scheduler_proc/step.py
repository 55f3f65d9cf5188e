"""What one ``schedule()`` call collects, and what one ``update_from_output()`` returns."""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.messages import CachedRequestData, NewRequestData, RequestDelta, iter_deltas

from pagedserve.scheduler_proc import prompt_logprobs as prompt_lp
from pagedserve.scheduler_proc.request import Sequence

_NO_BLOCKS: list[int] = []  # shared by every CachedRequestData without new blocks (and no drafts); never mutated


class StepPlan:
    """The batch one ``schedule()`` builds, as a record: what each sequence computes, the wire
    entries for it, and the cache moves. Planning changes no sequence: the scheduler applies the
    plan once it is built (``Scheduler._update_after_schedule``)."""

    __slots__ = ("budget", "new", "cached", "sampling_new", "sampling_cached", "others", "scheduled",
                 "swap_out", "swap_in", "preempted", "num_recomputed", "drafts", "request_slots", "window_blocks")

    def __init__(self, token_budget: int):
        self.budget = token_budget  # tokens still free in this step
        self.new: list = []  # NewRequestData
        self.cached: list = []  # CachedRequestData
        # Sequences in batch order: the ones that sample this step (new first, as the
        # workers list them in StepResult) and the ones computing a non-final prefill chunk.
        # The steady decodes (running.py) sample after all of these.
        self.sampling_new: list = []
        self.sampling_cached: list = []
        self.others: list = []
        self.scheduled: list[tuple[Sequence, int]] = []  # (sequence, tokens its KV gains), in planning order
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.preempted = False
        self.num_recomputed = 0  # tokens computed again after a recompute-preemption
        self.drafts: dict[str, list[int]] = {}  # speculative proposals by sequence id (speculation.py)
        self.request_slots: dict[str, int] = {}  # the LoRA slot of each new entry with an adapter (lora_slots.py)
        # a hybrid model's local tables, by sequence id: what the workers' copies gain (GroupedSchedulerOutput)
        self.window_blocks: dict[str, list[list[int]]] = {}

    def add(self, seq: Sequence, num_tokens: int, drafts: list[int] = _NO_BLOCKS) -> None:
        """``seq`` computes ``num_tokens`` tokens from its ``num_kv_tokens`` this step, then its
        proposals ``drafts`` (a decode that speculates), its blocks granted for all of them."""
        computed = seq.num_kv_tokens
        if seq.recompute_until > computed:
            self.num_recomputed += min(seq.recompute_until, computed + num_tokens) - computed
        self.budget -= num_tokens + len(drafts)
        self.scheduled.append((seq, num_tokens + len(drafts)))
        if drafts:
            self.drafts[seq.seq_id] = drafts
        tokens = seq.token_ids
        samples = computed + num_tokens == len(tokens) and seq.request.pooling is None
        if seq.worker_knows:
            sent = seq.num_tokens_sent
            blocks, blocks_sent = seq.block_ids, seq.num_blocks_sent
            self.cached.append(CachedRequestData(  # a decode's diff without slicing: its one new token
                seq.seq_id, [tokens[sent]] if sent == len(tokens) - 1 else tokens[sent:].tolist(),
                _NO_BLOCKS if blocks_sent == len(blocks) else blocks[blocks_sent:], computed, num_tokens, samples))
            (self.sampling_cached if samples else self.others).append(seq)
            if seq.window_tables and blocks_sent != len(blocks):
                self.window_blocks[seq.seq_id] = [table[blocks_sent:] for table in seq.window_tables]
        else:
            if seq.lora_slot >= 0:
                self.request_slots[seq.seq_id] = seq.lora_slot
            self.new.append(NewRequestData(
                seq.seq_id, tokens.tolist(), seq.num_prompt_tokens, list(seq.block_ids),
                computed, num_tokens, prompt_lp.sampling_to_send(seq.request, seq.sampling), samples,
                seq.request.pooling, sorted(seq.stop_token_ids) if seq.sampling.min_tokens else []))
            (self.sampling_new if samples else self.others).append(seq)
            if seq.window_tables:
                self.window_blocks[seq.seq_id] = [list(table) for table in seq.window_tables]

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is already in this batch as a per-object entry (O(batch): for preemptions only)."""
        return any(s is seq for s, _ in self.scheduled)


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
