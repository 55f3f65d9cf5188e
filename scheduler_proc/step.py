"""What one ``schedule()`` call collects, and what one ``update_from_output()`` returns."""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.messages import CachedRequestData, NewRequestData, RequestDelta, iter_deltas

from pagedserve.scheduler_proc import prompt_logprobs as prompt_lp
from pagedserve.scheduler_proc.request import Sequence

_NO_BLOCKS: list[int] = []  # shared by every CachedRequestData without new blocks; never mutated


class SchedulerStateError(RuntimeError):
    """The engine loop called the scheduler out of order (e.g. two schedules without an update)."""


class StepPlan:
    """The batch one ``schedule()`` builds: what each sequence computes, and the cache moves."""

    __slots__ = ("budget", "new", "cached", "sampling_new", "sampling_cached", "others",
                 "swap_out", "swap_in", "preempted", "num_recomputed", "drafts")

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
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.preempted = False
        self.num_recomputed = 0  # tokens computed again after a recompute-preemption
        self.drafts: dict[str, list[int]] = {}  # speculative proposals by sequence id (speculation.py)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` computes ``num_tokens`` tokens from its ``num_kv_tokens`` this step (its blocks granted)."""
        computed = seq.num_kv_tokens
        if seq.recompute_until > computed:
            self.num_recomputed += min(seq.recompute_until, computed + num_tokens) - computed
        seq.num_kv_tokens = computed + num_tokens
        self.budget -= num_tokens
        samples = computed + num_tokens == len(seq.token_ids) and seq.request.pooling is None
        if seq.worker_knows:
            self.cached.append(CachedRequestData(
                seq.seq_id, seq.token_ids[seq.num_tokens_sent:].tolist(), seq.block_ids[seq.num_blocks_sent:],
                computed, num_tokens, samples))
            (self.sampling_cached if samples else self.others).append(seq)
        else:
            self.new.append(NewRequestData(
                seq.seq_id, seq.token_ids.tolist(), seq.num_prompt_tokens, list(seq.block_ids),
                computed, num_tokens, prompt_lp.sampling_to_send(seq.request, seq.sampling), samples,
                seq.request.pooling, sorted(seq.stop_token_ids) if seq.sampling.min_tokens else []))
            seq.worker_knows = True
            (self.sampling_new if samples else self.others).append(seq)
        seq.num_tokens_sent = len(seq.token_ids)
        seq.num_blocks_sent = len(seq.block_ids)

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is already in this batch as a per-object entry (O(batch): for preemptions only)."""
        return any(s is seq for s in (*self.sampling_new, *self.sampling_cached, *self.others))

    def add_decode(self, seq: Sequence) -> None:
        """``add(seq, 1)`` for a decode the workers hold: its one new token, without slicing."""
        computed = seq.num_kv_tokens
        if seq.recompute_until > computed or not seq.worker_knows or seq.request.pooling is not None:
            self.add(seq, 1)  # a pooling request's last prompt token: computed, not sampled
            return
        blocks = seq.block_ids
        sent = seq.num_blocks_sent
        new_blocks = _NO_BLOCKS if sent == len(blocks) else blocks[sent:]
        tokens = seq.token_ids
        sent = seq.num_tokens_sent
        new_tokens = [tokens[computed]] if sent == computed else tokens[sent:].tolist()
        self.cached.append(CachedRequestData(seq.seq_id, new_tokens, new_blocks, computed, 1, True))
        self.sampling_cached.append(seq)
        self.budget -= 1
        seq.num_kv_tokens = computed + 1
        seq.num_tokens_sent = computed + 1
        seq.num_blocks_sent = len(blocks)

    def add_drafted(self, seq: Sequence, drafts: list[int]) -> None:
        """``add_decode`` followed by ``drafts`` (its slots granted): the step computes them too
        and samples after each; ``num_kv_tokens`` counts them until the result says which stay."""
        self.add_decode(seq)
        seq.num_kv_tokens += len(drafts)
        self.budget -= len(drafts)
        self.drafts[seq.seq_id] = drafts
        seq.spec.drafts = drafts


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
