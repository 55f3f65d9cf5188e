"""The scheduler: queues, admission and one step's batch. Pure CPU; no sockets, no torch.

Each ``schedule()``:

1. Running sequences, oldest first. Decodes always run (the token budget keeps one token
   for every later decode, so prefill chunks can never starve them); running prefills
   continue with a chunk of what is left. A sequence that needs a block that is not there
   preempts the *newest* running sequence, possibly itself, until it fits (swap to host
   when allowed and cheaper, recompute otherwise). Nothing is preempted while blocks suffice.
   Sequences in the decode lane (decode_lane.py: steady decodes held as numpy columns)
   get their block first if all of them fit, else they leave the lane for this loop;
   their one token each is reserved from the budget up front, and they are batched after
   the loop, minus any the loop preempted.
2. Only in a step that preempted nothing: swapped sequences resume (oldest first), then
   waiting ones are admitted strictly in arrival order; the first that does not fit stops
   admission, so nothing overtakes an older request. Skipping resumption in a preempting
   step also keeps this step's freed blocks out of swap-in destinations, whose data would
   otherwise be read by a copy or overwritten by a zero listed in the same step.

The output-side half (``update_from_output``) lives in output_processor.py.
"""

from __future__ import annotations

import random
from bisect import insort
from collections import deque
from operator import attrgetter

from pagedserve.protocol.messages import (AddRequest, CachedRequestData, NewRequestData, RequestDelta,
                                          SchedulerOutput, StepResult)

from pagedserve.scheduler_proc import admission, invariants, output_processor, overlap, prompt_logprobs as prompt_lp
from pagedserve.scheduler_proc.admission import length_limit, rejection_reason
from pagedserve.scheduler_proc.block_manager import BlockManager
from pagedserve.scheduler_proc.block_pool import CacheEventLog
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.decode_lane import DecodeLane
from pagedserve.scheduler_proc.grammar import step_bitmask
from pagedserve.scheduler_proc.grammar_cache import compile_for
from pagedserve.scheduler_proc.request import FINISHED, RUNNING, SWAPPED, WAITING, Request, Sequence, token_array
from pagedserve.scheduler_proc.stats import SchedulerCounters, snapshot
from pagedserve.scheduler_proc.step import SchedulerStateError, StepOutputs, StepPlan

_by_order = attrgetter("order")
_NO_BLOCKS: list[int] = []  # shared by every CachedRequestData without new blocks; never mutated


class Scheduler:
    def __init__(self, config: SchedulerConfig, grammars=None):
        self.config = config
        self.grammars = grammars  # CompiledGrammarCache (grammar_cache.py); None: structured output refused
        self.block_size = config.block_size
        self.len_limit = length_limit(config)
        self.counters = SchedulerCounters()
        self._rng = random.Random(config.seed)
        self._step = 0
        self._arrivals = 0
        self.cache_events = CacheEventLog()  # for the frontend's cache-aware router
        self._reset_state()

    def _reset_state(self) -> None:
        self.bm = BlockManager(self.config)
        self.bm.device.events = self.cache_events.restart()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()  # arrival order; recompute-preempted at the front
        self.running: list[Sequence] = []  # running outside the lane; arrival order, oldest first
        self.lane = DecodeLane(self.config.max_num_seqs, self.block_size)
        self.swapped: list[Sequence] = []  # arrival order, oldest first
        self.finished_ids: list[str] = []  # for the next SchedulerOutput
        self.num_gone_running = 0  # listed in running but finished, aborted or moved to the lane
        self.parent_seats = 0  # seats reserved for the children of running parents
        # Steps out at the workers, oldest first (at most two: one scheduled ahead), each as
        # (SchedulerOutput, sequences sampling outside the lane, other scheduled sequences).
        self.in_flight: list[tuple] = []

    # ------------------------------------------------------------------ frontend side

    def add_request(self, msg: AddRequest) -> list[RequestDelta]:
        reason = rejection_reason(msg, self.config)
        if reason is None and msg.request_id in self.requests:
            reason = f"request id {msg.request_id!r} is already in use"
        if reason is None:
            compiled, reason = compile_for(self.grammars, msg.sampling.structured_outputs)
        if reason is not None:
            self.counters.num_finished += 1
            n = msg.sampling.n
            indices = range(n) if 1 <= n <= self.config.max_num_seqs else range(1)  # never 10**9 deltas
            return [RequestDelta(msg.request_id, i, [], "error", reason, "invalid_request",
                                 len(msg.prompt_token_ids)) for i in indices]
        seed = self._rng.getrandbits(63) if msg.sampling.seed is None else msg.sampling.seed
        self._arrivals += 1
        request = Request(msg, self._arrivals, seed, self.len_limit, compiled)
        self.counters.structured_output_requests += compiled is not None
        seq = Sequence(msg.request_id, request, 0, token_array(msg.prompt_token_ids), request.sampling,
                       is_parent=msg.sampling.n > 1)
        request.sequences = [seq]
        self.requests[msg.request_id] = request
        self.waiting.append(seq)
        return []

    def abort_requests(self, request_ids: list[str]) -> list[RequestDelta]:
        deltas = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for seq in request.sequences:
                if seq.status != FINISHED:
                    self._drop(seq)
            deltas.extend(self._end_request(request, "abort", None, None))
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def fail_all(self, reason: str) -> list[RequestDelta]:
        """The workers died: every unfinished request ends with an engine error; state starts over."""
        deltas = []
        for request in list(self.requests.values()):
            deltas.extend(self._end_request(request, "error", reason, "engine"))
        self._reset_state()  # a fresh cache: the new workers hold nothing
        return deltas

    def _end_request(self, request: Request, finish: str, error, error_kind) -> list[RequestDelta]:
        deltas = [RequestDelta(request.request_id, i, [], finish, error, error_kind,
                               request.num_prompt_tokens, request.num_cached_tokens)
                  for i in sorted(request.unfinished_indices)]
        request.unfinished_indices.clear()
        request.sequences = []  # break the request <-> sequence cycle: freed without the collector
        del self.requests[request.request_id]
        self.counters.num_finished += 1
        return deltas

    def _drop(self, seq: Sequence) -> None:
        """Remove ``seq`` from its queue and give back its blocks."""
        if seq.lane_pos >= 0:
            self.lane.drop(seq)
        elif seq.status == RUNNING:
            self.num_gone_running += 1
            if seq.is_parent:
                self.parent_seats -= seq.request.sampling.n - 1
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == SWAPPED:
            self.swapped.remove(seq)
        self.bm.free(seq)
        if seq.worker_knows:
            self.finished_ids.append(seq.seq_id)
            seq.worker_knows = False
        seq.status = FINISHED

    # ------------------------------------------------------------------ worker side

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> StepOutputs:
        deltas = output_processor.process(self, out, result)
        if self.config.debug_invariants:
            self.check_invariants()
        return deltas

    def check_invariants(self) -> None:
        self.lane.sync_all()
        invariants.check(self)

    @property
    def num_running(self) -> int:
        return len(self.running) - self.num_gone_running + self.lane.n

    def running_sequences(self) -> list[Sequence]:
        """Every running sequence, oldest first, with its state synced (for tests and debugging)."""
        self.lane.sync_all()
        live = [s for s in self.running if s.status == RUNNING and s.lane_pos < 0]
        live += (s for s in self.lane.seqs if s.status == RUNNING)
        return sorted(live, key=_by_order)

    def stats(self) -> dict:
        return snapshot(self)

    # ------------------------------------------------------------------ one step

    @property
    def step(self) -> int:
        """The number of the last step scheduled (0 before the first)."""
        return self._step

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the result of the one out (overlap.py)."""
        return overlap.can_schedule_ahead(self)

    def schedule(self) -> SchedulerOutput:
        if self.in_flight and not self.can_schedule_ahead():
            raise SchedulerStateError(
                f"schedule() called again before update_from_output() for step {self.in_flight[0][0].step}, "
                f"and the next step cannot be scheduled ahead of it (can_schedule_ahead())")
        self._step += 1
        if self.num_gone_running:
            self.running = [seq for seq in self.running if seq.status == RUNNING and seq.lane_pos < 0]
            self.num_gone_running = 0
        batch = StepPlan(self.config.max_num_batched_tokens)
        for seq in self.lane.grant_blocks(self.bm):
            self._leave_lane(seq)
        batch.budget -= self.lane.n  # every lane decode runs: its token is reserved first
        self._schedule_running(batch)
        if not batch.preempted:
            admission.resume_swapped(self, batch)
            if not self.swapped:
                admission.admit_waiting(self, batch)
        return self._finish_step(batch)

    def _schedule_running(self, batch: StepPlan) -> None:
        running = self.running
        bs = self.block_size
        bm = self.bm
        cached_append = batch.cached.append
        sampling_append = batch.sampling_cached.append
        budget = batch.budget
        later_decodes = -1  # decodes after the current one; counted once a prefill needs it
        i = 0
        while i < len(running):
            seq = running[i]
            tokens = seq.token_ids
            computed = seq.num_kv_tokens
            if len(tokens) - computed == 1 and not seq.is_parent:  # the steady-state decode
                if computed % bs == 0 or seq.shared_tail:
                    batch.budget = budget
                    fits = self._make_room(seq, 1, batch)
                    budget = batch.budget  # a preempted lane sequence gave its token back
                    if not fits:
                        continue  # seq preempted itself: it was the last one
                    bm.append_slots(seq, 1)
                budget -= 1
                later_decodes -= 1
                seq.num_kv_tokens = computed + 1
                if seq.worker_knows:
                    blocks = seq.block_ids
                    num_blocks = len(blocks)
                    sent = seq.num_blocks_sent
                    if sent != num_blocks:
                        new_blocks = blocks[sent:]
                        seq.num_blocks_sent = num_blocks
                    else:
                        new_blocks = _NO_BLOCKS
                    sent = seq.num_tokens_sent
                    new_tokens = [tokens[computed]] if sent == computed else tokens[sent:].tolist()
                    cached_append(CachedRequestData(seq.seq_id, new_tokens, new_blocks, computed, 1, True))
                    seq.num_tokens_sent = computed + 1
                    sampling_append(seq)
                else:
                    batch.budget = budget
                    self.emit(seq, computed, 1, batch)
                i += 1
                continue
            # A prefill continuing (or a parent's prompt[:-1]): a chunk of what is left.
            if later_decodes < 0:
                later_decodes = sum(1 for s in running[i + 1:]
                                    if len(s.token_ids) - s.num_kv_tokens == 1 and not s.is_parent)
            batch.budget = budget
            num_tokens = self.chunk_size(seq.target_len - computed, budget - later_decodes)
            if num_tokens > 0:
                num_tokens = self._make_room(seq, num_tokens, batch)
                budget = batch.budget
                if num_tokens == 0:
                    continue
                bm.append_slots(seq, num_tokens)
                self.emit(seq, computed, num_tokens, batch)
                budget = batch.budget
            i += 1
        batch.budget = budget

    def chunk_size(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _make_room(self, seq: Sequence, num_tokens: int, batch: StepPlan) -> int:
        """Preempt the newest running sequences until ``seq`` fits; how many tokens it may compute.

        When ``seq`` is itself the newest, its chunk shrinks to what fits; when not even one
        token fits it is preempted and 0 is returned.
        """
        bm = self.bm
        while not bm.can_append_slots(seq, num_tokens):
            victim = self._newest_running()
            if victim is not seq:
                self._preempt(victim, batch)
                continue
            fit = min(num_tokens, bm.max_appendable_tokens(seq))
            if fit > 0 and (self.config.enable_chunked_prefill or fit == num_tokens):
                return fit
            self._preempt(seq, batch)
            return 0
        return num_tokens

    def _newest_running(self) -> Sequence:
        lane, running = self.lane, self.running
        if not lane.n:
            return running[-1]
        newest = lane.newest()
        return running[-1] if running and running[-1].order > newest.order else newest

    def _leave_lane(self, seq: Sequence) -> None:
        """Back to the per-object path (in arrival order) for this step's loop."""
        self.lane.leave(seq)
        insort(self.running, seq, key=_by_order)

    def _preempt(self, seq: Sequence, batch: StepPlan) -> None:
        """Take the newest running sequence off the device, by swap or by recompute."""
        if seq.lane_pos >= 0:
            self.lane.leave(seq)
            self.bm.release_unused(seq)  # a block granted this step
            batch.budget += 1  # its reserved decode token
        else:
            self.running.pop()
        batch.preempted = True
        seq.num_preemptions += 1
        if seq.is_parent:
            self.parent_seats -= seq.request.sampling.n - 1
        if seq.worker_knows:
            self.finished_ids.append(seq.seq_id)
            seq.worker_knows = False
        if self._should_swap(seq):
            batch.swap_out.extend(self.bm.swap_out(seq))
            seq.status = SWAPPED
            insort(self.swapped, seq, key=_by_order)
            self.counters.num_preemptions_swap += 1
            return
        seq.recompute_until = max(seq.recompute_until, seq.num_kv_tokens)
        self.bm.free(seq)
        seq.num_kv_tokens = 0
        seq.block_keys = []
        seq.shared_tail = False
        seq.status = WAITING
        position = 0  # behind older preempted sequences, ahead of every newer one
        waiting = self.waiting
        while position < len(waiting) and waiting[position].order < seq.order:
            position += 1
        waiting.insert(position, seq)
        self.counters.num_preemptions_recompute += 1

    def _should_swap(self, seq: Sequence) -> bool:
        mode = self.config.preemption_mode  # auto: under one full block, recompute is cheaper than a move
        if mode == "recompute" or not self.bm.can_swap_out(seq):
            return False
        return mode == "swap" or seq.num_kv_tokens >= self.block_size

    def seats_free(self) -> int:
        return self.config.max_num_seqs - len(self.running) - self.lane.n - self.parent_seats

    def enter_running(self, seq: Sequence) -> None:
        seq.status = RUNNING
        if seq.is_parent:
            self.parent_seats += seq.request.sampling.n - 1
        running = self.running
        if not running or running[-1].order < seq.order:
            running.append(seq)
        else:
            insort(running, seq, key=_by_order)

    def emit(self, seq: Sequence, computed: int, num_tokens: int, batch: StepPlan) -> None:
        """Put ``seq`` in the batch computing ``num_tokens`` tokens from position ``computed``."""
        if seq.recompute_until > computed:
            self.counters.recomputed_tokens += min(seq.recompute_until, computed + num_tokens) - computed
        seq.num_kv_tokens = computed + num_tokens
        batch.budget -= num_tokens
        samples = computed + num_tokens == len(seq.token_ids)
        if seq.worker_knows:
            batch.cached.append(CachedRequestData(
                seq.seq_id, seq.token_ids[seq.num_tokens_sent:].tolist(), seq.block_ids[seq.num_blocks_sent:],
                computed, num_tokens, samples))
            (batch.sampling_cached if samples else batch.others).append(seq)
        else:
            batch.new.append(NewRequestData(
                seq.seq_id, seq.token_ids.tolist(), seq.num_prompt_tokens, list(seq.block_ids),
                computed, num_tokens, prompt_lp.sampling_to_send(seq.request, seq.sampling), samples))
            seq.worker_knows = True
            (batch.sampling_new if samples else batch.others).append(seq)
        seq.num_tokens_sent = len(seq.token_ids)
        seq.num_blocks_sent = len(seq.block_ids)

    def _finish_step(self, batch: StepPlan) -> SchedulerOutput:
        decodes = self.lane.schedule()
        zero, copies = self.bm.drain()
        finished, self.finished_ids = self.finished_ids, []
        total = self.config.max_num_batched_tokens - batch.budget
        sampling = batch.sampling_new + batch.sampling_cached
        masks = step_bitmask(sampling, self.grammars.words_per_row, self.counters) if self.grammars else None
        out = SchedulerOutput(self._step, batch.new, batch.cached, decodes, finished, batch.swap_out,
                              batch.swap_in, copies, zero, total, masks)
        counters = self.counters
        counters.num_blocks_zeroed += len(zero)
        counters.num_blocks_copied += len(copies)
        counters.num_blocks_swapped_out += len(batch.swap_out)
        counters.num_blocks_swapped_in += len(batch.swap_in)
        if total:
            self.in_flight.append((out, sampling, batch.others))
        if self.config.debug_invariants:
            self.check_invariants()
        return out
