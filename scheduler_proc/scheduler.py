"""The scheduler: the one owner of the queues, the counters and every step's batch. Pure CPU.

Each ``schedule()``:

0. Requests past a time limit end (deadlines.py; time enters only as the step's clock). Running
   requests that a waiting one outranks (policy.py) are preempted for it, never in a step
   scheduled ahead of a result.
1. Running sequences, in the policy's order (FCFS: oldest first). Decodes always run: the token
   budget keeps one token for every later decode, so prefill chunks never starve them. While a
   sequence cannot have its blocks, the policy's victim (FCFS: the newest, possibly itself) is
   preempted, by swap when allowed and cheaper, else by recompute. Steady decodes (running.py)
   get their blocks first if all fit; their tokens are reserved up front.
2. Only in a step that preempted nothing: swapped sequences resume and waiting ones are admitted
   in the policy's order; the first that does not fit stops admission, so nothing overtakes it.
   (A preempting step's freed blocks must not become swap-in destinations that a copy or zero
   listed in the same step would touch.) A waiting sequence whose LoRA adapter must wait for a
   slot (lora_slots.py) is set aside instead: the ones behind it may start, and a resident adapter
   drains until its slot frees for it, so its wait is bounded.

Helpers answer questions and return decisions (admission.py, output_processor.py, policy.py,
speculation.py); only this class applies them to the queues, sequences, blocks and counters: a
step's plan (``StepPlan``, a record) once it is built (``_update_after_schedule``), a result's
samples in ``_apply_samples``, as vLLM's ``_update_after_schedule`` and ``update_from_output`` do;
the steady decodes' columns (running.py) move at the same two places.
"""

from __future__ import annotations

import random
import time
from bisect import insort
from collections import deque
from typing import Iterable, Optional

from pagedserve.protocol.messages import (AddRequest, GroupedSchedulerOutput, LoRAAdapter, LoRAStep, RequestDelta,
                                          SchedulerOutput, StepResult)
from pagedserve.protocol.priority import QUEUE_TIMEOUT

from pagedserve.scheduler_proc import admission, invariants, output_processor, prefix_cache
from pagedserve.scheduler_proc.admission import Admission, length_limit
from pagedserve.scheduler_proc.block_manager import BlockManager
from pagedserve.scheduler_proc.block_pool import CacheEventLog
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.deadlines import RequestTimes, queue_timeout_message
from pagedserve.scheduler_proc.decode_lane import lane_kind
from pagedserve.scheduler_proc.grammar import step_bitmask
from pagedserve.scheduler_proc.lora_slots import NO_SLOT, LoRASlots, unloaded_message
from pagedserve.scheduler_proc.policy import policy_for
from pagedserve.scheduler_proc.request import FINISHED, RUNNING, SWAPPED, WAITING, Request, Sequence, token_array
from pagedserve.scheduler_proc.running import RunningSequences, by_order
from pagedserve.scheduler_proc.speculation import spec_k_for, speculator_for
from pagedserve.scheduler_proc.stats import SchedulerCounters, snapshot
from pagedserve.scheduler_proc.step import StepOutputs, StepPlan


class SchedulerStateError(RuntimeError):
    """The engine loop called the scheduler out of order (e.g. two schedules without an update)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, grammars=None, policy=None, clock=time.monotonic, proposer=None,
                 lora_adapters: Iterable[LoRAAdapter] = ()):
        self.config = config
        self.grammars = grammars  # CompiledGrammarCache (grammar_cache.py); None: structured output refused
        self.policy = policy_for(config) if policy is None else policy
        self.clock = clock  # read once per schedule() that is not handed a time (replay hands the recorded one)
        self.times = RequestTimes(config.max_queue_time_s, config.default_deadline_s)
        self.timed_out: list[RequestDelta] = []  # ends by a time limit, for the engine to send (take_timed_out)
        self.block_size = config.block_size
        self.len_limit = length_limit(config)
        self.counters = SchedulerCounters()
        self._rng = random.Random(config.seed)
        self._step = 0
        self._arrivals = 0
        self.cache_events = CacheEventLog()  # for the frontend's cache-aware router
        self.speculator = speculator_for(config.speculative, proposer)  # None: no speculative decoding
        # The registered LoRA adapters and the slots they occupy; they outlive fail_all (None: LoRA off).
        self.lora = LoRASlots(config.max_loras) if config.enable_lora else None
        self._reset_state()
        for adapter in lora_adapters:  # a predecessor's, when the engine replaces this scheduler
            self.register_lora(adapter)

    def _reset_state(self) -> None:
        self.bm = BlockManager(self.config)
        self.bm.device.events = self.cache_events.restart()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()  # arrival order; recompute-preempted by their own arrival
        self.running = RunningSequences(self.config.max_num_seqs, self.block_size)
        self.swapped: list[Sequence] = []  # arrival order, oldest first
        self.finished_ids: list[str] = []  # for the next SchedulerOutput
        self.in_flight: list[tuple] = []  # steps out, oldest first (<= 2): (output, sampling seqs, others)
        self._invariant_blocks = (set(), set())  # the tables' blocks at the last check (invariants.py)

    def add_request(self, msg: AddRequest) -> list[RequestDelta]:
        adapters = self.lora.registered if self.lora is not None else {}
        verdict = admission.judge_new(msg, self.config, self.requests, self.grammars, len(self.waiting), adapters)
        if verdict.reason is not None:
            self.counters.num_requests_shed += verdict.kind == "overloaded"
            self.counters.num_finished += 1
            return verdict.error_deltas(msg, self.config.max_num_seqs)
        compiled = verdict.compiled
        seed = self._rng.getrandbits(63) if msg.sampling.seed is None else msg.sampling.seed
        self._arrivals += 1
        lora = adapters[msg.lora_name] if msg.lora_name else None
        request = Request(msg, self._arrivals, seed, self.len_limit, compiled,
                          spec_k=spec_k_for(self.speculator, msg, compiled), lora=lora)  # proposals per step
        if lora is not None:
            self.lora.bind(lora)
        self.times.arrived(request)
        self.policy.arrived(request)
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
            if request is not None:
                deltas.extend(self._end(request, "abort"))
        return deltas

    def register_lora(self, adapter: LoRAAdapter) -> None:
        """``LoadLoRA``: requests may name ``adapter`` from now on. Replacing a name's adapter (another
        digest) moves the requests of the old one that have not started to the new one; the started
        ones finish with the weights they started with."""
        old = self.lora.register(adapter)
        if old is None:
            return
        for request in self.requests.values():
            if request.lora == old and not _started(request):
                self.lora.closed(old)
                request.bind_lora(adapter)
                self.lora.bind(adapter)

    def unregister_lora(self, name: str) -> list[RequestDelta]:
        """``UnloadLoRA``: no new request may name it; its requests that have not started end with an
        error naming it, and the started ones finish (the workers forget it after the last)."""
        old = self.lora.unregister(name)
        if old is None:
            return []
        return [delta for request in [r for r in self.requests.values() if r.lora == old and not _started(r)]
                for delta in self._end(request, "error", unloaded_message(name), "invalid_request")]

    def lora_adapters(self) -> list[LoRAAdapter]:
        """The registered adapters, in registration order (for a scheduler that replaces this one)."""
        return list(self.lora.registered.values()) if self.lora is not None else []

    def has_lora_changes(self) -> bool:
        """Whether the workers have adapter changes to hear of (registered, unloaded) before any step."""
        return self.lora is not None and self.lora.has_changes()

    def take_lora_step(self) -> Optional[LoRAStep]:
        """The LoRA changes of the step ``schedule()`` just returned, to send right before it; None
        when it has none (always, without --enable-lora: the workers get exactly the frames they did)."""
        return self.lora.take_step(self._step) if self.lora is not None else None

    def _end(self, request: Request, finish: str, error=None, error_kind=None) -> list[RequestDelta]:
        for seq in request.sequences:  # wherever they are
            if seq.status != FINISHED:
                self._drop(seq)
        return self._end_request(request, finish, error, error_kind)

    def take_timed_out(self) -> list[RequestDelta]:
        deltas, self.timed_out = self.timed_out, []
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def fail_all(self, reason: str) -> list[RequestDelta]:
        """The workers died: every unfinished request ends with an engine error; state starts over."""
        deltas = [d for request in list(self.requests.values())
                  for d in self._end_request(request, "error", reason, "engine")]
        self._reset_state()  # a fresh cache: the new workers hold nothing
        if self.lora is not None:
            self.lora.workers_replaced()
        return deltas

    def _end_request(self, request: Request, finish: str, error, error_kind) -> list[RequestDelta]:
        deltas = [RequestDelta(request.request_id, i, [], finish, error, error_kind,
                               request.num_prompt_tokens, request.num_cached_tokens)
                  for i in sorted(request.unfinished_indices)]
        request.unfinished_indices.clear()
        self._close(request)
        return deltas

    def _close(self, request: Request) -> None:
        del self.requests[request.request_id]
        self.policy.closed(request)
        if request.lora is not None:
            self.lora.closed(request.lora)
        self.counters.count_closed(request)
        request.sequences = []  # break the request <-> sequence cycle: freed without the collector
        self.counters.num_finished += 1

    def _drop(self, seq: Sequence) -> None:
        """Remove ``seq`` from its queue and give back its blocks."""
        if seq.status == RUNNING:
            self.running.discard(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == SWAPPED:
            self.swapped.remove(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        """``seq`` is off every queue: its blocks and LoRA slot back, the workers told."""
        self.bm.free(seq)
        if seq.lora_slot != NO_SLOT:
            self.lora.release(seq)
        if seq.worker_knows:
            self.finished_ids.append(seq.seq_id)
            seq.worker_knows = False
        seq.status = FINISHED

    def _retire(self, seq: Sequence) -> None:
        """``seq`` ended with its last sample and left the running set: its request closes with its last one."""
        self._forget(seq)
        request = seq.request
        request.unfinished_indices.discard(seq.index)
        if not request.unfinished_indices:
            self._close(request)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """A running parent that computed prompt[:-1] gives way to its n children, sharing its blocks."""
        children = output_processor.children_of(parent)
        self.bm.fork(parent, children)
        if parent.lora_slot != NO_SLOT:  # all samples of a request share its adapter
            for child in children:
                self.lora.share(child, parent.lora_slot)
        self.running.replace(parent, children)
        self._forget(parent)  # its blocks are the children's now
        parent.request.sequences = children
        return children

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> StepOutputs:
        if not self.in_flight or self.in_flight[0][0] is not out:
            # An empty step (nothing computed), or a step that fail_all() already wrote off.
            return StepOutputs([])
        _, sampling, others = self.in_flight[0]
        output_processor.check_result(out, result, len(sampling))
        self.in_flight.pop(0)
        sampled = output_processor.read_samples(out, result, sampling, others, self.speculator)
        outputs = self._apply_samples(sampled, result.sampled_token_ids[len(sampling):], sampling, others)
        self.policy.sampled(outputs, self.requests)
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    def _apply_samples(self, sampled: output_processor.Sampled, steady_tokens: list[int], sampling: list[Sequence],
                       others: list[Sequence]) -> StepOutputs:
        """A step's samples applied in one place: the per-object ones' tokens appended, the KV and
        the blocks of rejected proposals given back, full blocks named in the prefix cache, the ended
        retired; then the steady decodes' tokens in their columns (``running.record_steady``) and
        their ended retired; the ones with only decodes ahead moved to the steady batch; parents that
        computed their prompt forked."""
        block_size = self.block_size
        pool = self.bm.device if self.config.enable_prefix_caching else None
        if pool is not None:  # ended embedding requests' blocks outlive them (last-token pooling hits them)
            for seq in sampled.ended:
                if seq.request.pooling is not None:
                    prefix_cache.register_computed(pool, seq, block_size)
        verified = []
        for seq, tokens, rejected in sampled.appended:
            seq.token_ids.extend(tokens)
            if rejected is not None:
                seq.num_kv_tokens -= rejected
                seq.spec.drafts = []  # verified
                verified.append(seq)
            if pool is not None and seq.num_kv_tokens // block_size > len(seq.block_keys):
                # after the append: an accepted proposal's block holds tokens sampled only now
                seq.num_kv_tokens = min(seq.num_kv_tokens, len(seq.token_ids))
                prefix_cache.register_computed(pool, seq, block_size)
        for seq in verified:  # the workers drop the same blocks (protocol/step_state.py, note_accepted)
            self.bm.release_unused(seq)
            seq.num_blocks_sent = min(seq.num_blocks_sent, len(seq.block_ids))
        for seq in sampled.ended:
            self.running.discard(seq)
            self._retire(seq)
        deltas, num_accepted = sampled.deltas, sampled.num_accepted
        if steady_tokens:
            num_per_object_deltas = len(deltas)
            outputs, ended, num_steady = self.running.record_steady(steady_tokens, deltas, sampled.orders, pool)
            for seq in ended:  # already out of the running set
                self._retire(seq)
            num_accepted += num_steady
            if len(deltas) > max(num_per_object_deltas, 1):  # the steady ends come in their batch's order
                outputs.deltas = output_processor.in_arrival_order(deltas, sampled.orders)
        else:
            outputs = StepOutputs(deltas)
        self.counters.generation_tokens += num_accepted
        for seq in sampling:  # with a batch out, behind its positions (running.after_sample)
            self.running.after_sample(seq)
        others = [seq for seq in others if seq.status == RUNNING]
        if pool is not None:  # the blocks the non-sampling sequences filled
            for seq in others:
                prefix_cache.register_computed(pool, seq, block_size)
        for parent in output_processor.parents_to_fork(others):
            self._fork(parent)
        return outputs

    def check_invariants(self, out: Optional[SchedulerOutput] = None) -> None:  # O(blocks + tokens)
        invariants.check(self, out)  # every step only with debug_invariants; ``out``: the step built

    def running_sequences(self) -> list[Sequence]:
        """Every running sequence, oldest first (for tests and debugging)."""
        return self.running.in_order()

    def stats(self) -> dict:
        return snapshot(self)

    @property
    def step(self) -> int:
        """The number of the last step scheduled (0 before the first)."""
        return self._step

    def can_schedule_ahead(self) -> bool:
        """Async scheduling's rule: whether the next step may go out before the result of the one out.

        Overlapped scheduling covers the steady state of plain decodes; everything else waits for
        the result (docs/DECISIONS.md). Ahead is allowed when exactly one step is out, no waiting
        sequence outranks a running one (its victim would be chosen with a token in flight), and:

        1. every sequence sampling in it is a steady decode (running.py), so no token a per-object
           sequence needs is unknown; except sequences that sit the step ahead out: grammar-constrained
           ones (never steady; their mask needs the token still in flight, so they wait for it, vLLM's
           choice) and ones sampling their way into the steady batch (a prompt's first token), which
           join it when their token arrives, while the step ahead is out (``lane_kind``); with no
           steady decode to overlap, nobody waits for nothing;
        2. the free blocks cover every block the running sequences can ask for, so the step
           preempts nothing: no in-flight sequence is swapped or recomputed with a token still
           unknown, and no steady decode leaves the batch for the per-object path while its token is
           in flight.

        Sequences with nothing to compute until the result arrives (a parent about to fork) simply
        sit the step out. A steady decode that ends meanwhile holds nothing back: the batch out
        that computes a token past its end drops it (running.py).
        """
        if len(self.in_flight) != 1:
            return False
        sampling, running, bm = self.in_flight[0][1], self.running, self.bm
        if sampling and not running.num_steady:  # only the ones sampling would run, and they sit it out
            return False
        if any(seq.grammar is None and not lane_kind(seq) for seq in sampling):
            return False  # one that would not join the steady batch keeps its every-step decode by being waited for
        free = bm.device.num_free - running.num_steady_needing_blocks() * bm.num_tables
        budget = self.config.max_num_batched_tokens
        for seq in running.per_object():  # rule 2: an upper bound on what the per-object loop can take
            if free < 0:
                return False
            remaining = seq.target_len - seq.num_kv_tokens
            if remaining > 0:
                free -= bm.num_new_blocks(seq, min(remaining, budget))
        return free >= 0 and self.policy.victim_for_waiting(self) is None

    def schedule(self, now: Optional[float] = None) -> SchedulerOutput:
        """One step; ``now``: its clock (default: ``self.clock()``), recorded in the output."""
        if self.in_flight and not self.can_schedule_ahead():
            raise SchedulerStateError(
                f"schedule() called again before update_from_output() for step {self.in_flight[0][0].step}, "
                f"and the next step cannot be scheduled ahead of it (can_schedule_ahead())")
        self._step += 1
        self._end_past_limits(self.clock() if now is None else now)
        batch = StepPlan(self.config.max_num_batched_tokens)
        if not self.in_flight:  # no victim while a step out may hold its token (can_schedule_ahead, rule 2)
            self._make_way_for_waiting(batch)
        release = self.bm.release_behind_window if self.bm.frees_behind_window else None
        if needy := self.running.begin_step(self.bm.device.num_free, release, self.bm.num_tables):
            self.running.grant_steady(needy, self.bm.append_global_blocks(needy))
            if self.bm.num_window_groups:  # a hybrid model's local tables: the step's window_block_ids carries them
                for seq in needy:
                    batch.window_blocks[seq.seq_id] = self.bm.append_local_blocks(seq)
        batch.budget -= self.running.num_steady  # every steady decode runs: its token comes first
        self._schedule_running(batch)
        if not batch.preempted:
            self._start_swapped_and_waiting(batch)
        return self._finish_step(batch)

    def _end_past_limits(self, now: float) -> None:
        """Past a limit (deadlines.py): without a first token an error, else the tokens so far ("length")."""
        self.policy.now = now
        for request, missed_first in self.times.advance(now, self.requests):
            self.counters.count_miss(request, missed_first)
            error = queue_timeout_message(request, now, self.config.max_queue_time_s) if missed_first else None
            self.timed_out += self._end(request, "error" if error else "length", error, error and QUEUE_TIMEOUT)

    def _make_way_for_waiting(self, batch: StepPlan) -> None:
        """Victims for a waiting sequence that outranks them, before anything is scheduled: the step
        may still admit, as no copy or zero is listed for the freed blocks yet."""
        while (victim := self.policy.victim_for_waiting(self)) is not None:
            self._preempt(victim, batch)
        batch.budget, batch.preempted = self.config.max_num_batched_tokens, False  # no decode reserved yet

    def _schedule_running(self, batch: StepPlan) -> None:
        queue = self.policy.running_order(self.running.per_object())
        later_decodes = None  # decodes after the current sequence; counted once a prefill needs it
        windowed = self.bm.frees_behind_window
        for i, seq in enumerate(queue):
            if seq.status != RUNNING:
                continue  # preempted for an older sequence earlier in this step
            if windowed:
                self._release_behind_window(seq)
            if seq.is_decode:
                if self._make_room(seq, 1, batch):  # its one token's block is free; proposals take what is spare
                    later = len(queue) - i - 1  # a bound on the decodes still to come
                    drafts = self.speculator.propose(seq, batch.budget - 1 - later) if seq.spec is not None else ()
                    if drafts:  # only in blocks that leave one free for each later sequence of the step
                        drafts = drafts[:self.bm.num_extra_fitting(seq, 1, len(drafts), later)]
                    self.bm.append_slots(seq, 1 + len(drafts))
                    batch.add(seq, 1, drafts)
                if later_decodes is not None:
                    later_decodes -= 1
                continue
            if later_decodes is None:  # a prefill continuing (or a parent's prompt[:-1])
                later_decodes = sum(1 for s in queue[i + 1:] if s.status == RUNNING and s.is_decode)
            num_tokens = admission.chunk_size(seq.target_len - seq.num_kv_tokens, batch.budget - later_decodes,
                                              self.config.enable_chunked_prefill)
            if num_tokens > 0:
                num_tokens = self._make_room(seq, num_tokens, batch)
                if num_tokens > 0:
                    self.bm.append_slots(seq, num_tokens)
                    batch.add(seq, num_tokens)

    def _make_room(self, seq: Sequence, num_tokens: int, batch: StepPlan) -> int:
        """Preempt the policy's victims until ``seq`` fits; how many tokens it may compute (when it
        is the victim itself: what fits, or 0 after preempting it)."""
        bm = self.bm
        while not bm.can_append_slots(seq, num_tokens):
            victim = self.policy.victim(self.running)
            if victim is not seq:
                self._preempt(victim, batch)
                continue
            fit = min(num_tokens, bm.max_appendable_tokens(seq))
            if fit > 0 and (self.config.enable_chunked_prefill or fit == num_tokens):
                return fit
            self._preempt(seq, batch)
            return 0
        return num_tokens

    def _release_behind_window(self, seq: Sequence) -> None:
        """Blocks behind the window of ``seq``'s next query back to the pool (sliding_window.py);
        proposals still being verified do not count: a rejection moves the next query back."""
        position = seq.num_kv_tokens - (len(seq.spec.drafts) if seq.spec is not None else 0)
        self.bm.release_behind_window(seq, position)

    def _preempt(self, seq: Sequence, batch: StepPlan) -> None:
        """Take a running sequence off the device, by swap or by recompute."""
        if batch.holds(seq):  # un-scheduling a victim is not supported (FCFS's newest never is one)
            raise SchedulerStateError(f"the policy chose {seq.seq_id!r}, already scheduled this step, as a victim")
        if self.running.preempt(seq):  # a steady decode: its reserved token back, and a block granted unwritten
            batch.budget += 1
            self.bm.release_unused(seq)
            batch.window_blocks.pop(seq.seq_id, None)  # its local grants too: the workers drop it this step
        batch.preempted = True
        seq.num_preemptions += 1
        if seq.worker_knows:
            self.finished_ids.append(seq.seq_id)
            seq.worker_knows = False
        if self.bm.frees_behind_window:  # only the live blocks are swapped
            self._release_behind_window(seq)
        if admission.should_swap(seq, self.bm, self.config):
            batch.swap_out.extend(self.bm.swap_out(seq))
            seq.status = SWAPPED
            insort(self.swapped, seq, key=by_order)
            self.counters.num_preemptions_swap += 1
            return
        seq.recompute_until = max(seq.recompute_until, seq.num_kv_tokens)
        self.bm.free(seq)
        if seq.lora_slot != NO_SLOT:  # it comes back as a new request, with a slot again
            self.lora.release(seq)
        seq.num_kv_tokens = 0
        seq.block_keys = []
        seq.shared_tail = False
        seq.status = WAITING
        insort(self.waiting, seq, key=by_order)  # behind older preempted sequences, ahead of newer ones
        self.counters.num_preemptions_recompute += 1

    def seats_free(self) -> int:
        return self.config.max_num_seqs - self.running.num_seats

    def lora_must_wait(self, seq: Sequence) -> bool:
        """Whether ``seq`` cannot start for its LoRA adapter (no slot, or being drained): only a
        waiting one; a swapped one still holds its slot."""
        return seq.request.lora is not None and seq.status == WAITING and self.lora.must_wait(seq.request.lora)

    def _start_swapped_and_waiting(self, batch: StepPlan) -> None:
        """In the policy's order (FCFS: swapped ones first); the first that does not fit stops the
        rest, except a waiting one whose LoRA adapter must wait for a slot: it and its adapter's
        other waiting sequences are set aside for this step (the policy sees the queue without
        them), so base-model and resident adapters' requests behind it are not held up by it."""
        if self.seats_free() <= 0:  # nothing can start (and the waiting need not be walked for set-asides)
            return
        held: set[LoRAAdapter] = set()
        waiting: deque | WaitingWithout = self.waiting
        while True:
            seq = self.policy.next_to_start(self.swapped, waiting)
            if seq is None:
                if held:
                    self.lora.pass_complete(held)
                return
            if self.seats_free() < admission.seats_needed(seq):
                return
            if self.lora_must_wait(seq):
                self.lora.hold_back(seq.request.lora)
                if not held:
                    waiting = WaitingWithout(self.waiting, held)  # sees ``held`` grow
                held.add(seq.request.lora)
                continue
            if seq.status == SWAPPED:
                num_tokens = admission.tokens_to_resume(seq, self.bm, batch.budget, self.config.enable_chunked_prefill)
                if not num_tokens:
                    return
                self._resume(seq, num_tokens, batch)
                continue
            if batch.budget <= 0:
                return
            plan = admission.plan_admission(seq, self.bm, self.config, batch.budget, len(self.running),
                                            admission.window_growth(self.config, self.running))
            if plan is None:
                return
            self._admit(plan, batch)

    def _resume(self, seq: Sequence, num_tokens: int, batch: StepPlan) -> None:
        self.swapped.remove(seq)  # the head under FCFS: found at once
        batch.swap_in.extend(self.bm.swap_in(seq))
        if self.config.enable_prefix_caching:
            prefix_cache.republish(self.bm.device, seq)
        self.bm.append_slots(seq, num_tokens)
        seq.status = RUNNING
        self.running.add(seq)
        batch.add(seq, num_tokens)

    def _admit(self, plan: Admission, batch: StepPlan) -> None:
        seq = plan.seq
        self.waiting.remove(seq)  # the head under FCFS: found at once
        request = seq.request
        first = seq.num_preemptions == 0
        self.counters.count_admission(plan, first)
        if first:
            self.policy.admitted(seq)
            request.num_cached_tokens = plan.num_computed
        seq.num_cached_tokens = request.num_cached_tokens
        self.bm.allocate(seq, plan.hits, plan.num_blocks, plan.num_behind, plan.window_hits, plan.window_behind)
        seq.block_keys = plan.keys
        if request.lora is not None:
            self.lora.acquire(seq, request.lora)
        seq.num_kv_tokens = plan.num_computed
        seq.status = RUNNING
        self.running.add(seq)
        if plan.num_tokens > 0:
            batch.add(seq, plan.num_tokens)
        elif plan.forks_now:  # sample right away
            for child in self._fork(seq):
                if batch.budget > 0 and self.bm.can_append_slots(child, 1):
                    self.bm.append_slots(child, 1)
                    batch.add(child, 1)

    def _update_after_schedule(self, batch: StepPlan) -> None:
        """The plan applied to its sequences in one place: the tokens each computes (its proposals
        counted until their result says which stay), and what the workers now hold of it; the
        steady decodes' the same in their columns."""
        drafts = batch.drafts
        for seq, num_tokens in batch.scheduled:
            seq.num_kv_tokens += num_tokens
            seq.num_tokens_sent = len(seq.token_ids)
            seq.num_blocks_sent = len(seq.block_ids)
            seq.worker_knows = True
            if drafts and seq.seq_id in drafts:
                seq.spec.drafts = drafts[seq.seq_id]
        self.running.after_schedule()

    def _finish_step(self, batch: StepPlan) -> SchedulerOutput:
        decodes = self.running.steady_batch()
        self._update_after_schedule(batch)
        if self.lora is not None:
            self.lora.step_planned(batch.request_slots)
        zero, copies = self.bm.drain()
        finished, self.finished_ids = self.finished_ids, []
        total = self.config.max_num_batched_tokens - batch.budget
        sampling = batch.sampling_new + batch.sampling_cached
        masks = None
        if self.grammars:
            started = time.perf_counter()
            if (masks := step_bitmask(sampling, self.grammars.words_per_row)) is not None:
                self.counters.structured_output_mask_time_s += time.perf_counter() - started
        grouped = {"window_block_ids": batch.window_blocks} if self.bm.num_window_groups else None
        out = (GroupedSchedulerOutput if grouped is not None else SchedulerOutput)(
            self._step, batch.new, batch.cached, decodes, finished, batch.swap_out, batch.swap_in, copies, zero,
            total, masks, now_s=self.times.now, spec_token_ids=batch.drafts, **(grouped or {}))
        self.counters.count_step(batch, len(zero), len(copies))
        if self.speculator is not None:
            self.speculator.observe_step(out, batch)  # its clock prices a proposal (spec_cost.py)
        if total:
            self.in_flight.append((out, sampling, batch.others))
        if self.config.debug_invariants:
            self.check_invariants(out)
        return out


def _started(request: Request) -> bool:
    """Whether any sequence of ``request`` was ever admitted (a fork's children were, at birth)."""
    return any(seq.status != WAITING or seq.num_preemptions for seq in request.sequences)


class WaitingWithout:
    """The waiting queue as a policy sees it while the sequences of ``held`` adapters are set aside
    for the rest of an admission pass: what ``next_to_start`` reads of a queue (truth, ``[0]``,
    iteration), in order. During a pass the queue only loses the sequences admitted from it, so a
    snapshot with a cursor past the head's set-aside ones costs O(waiting) per pass, not per admission."""

    __slots__ = ("seqs", "held", "start")

    def __init__(self, queue: deque, held: set):
        self.seqs, self.held, self.start = list(queue), held, 0

    def _visible(self, seq: Sequence) -> bool:
        return seq.status == WAITING and seq.request.lora not in self.held

    def __iter__(self):
        seqs, visible = self.seqs, self._visible
        return (seqs[i] for i in range(self.start, len(seqs)) if visible(seqs[i]))

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("only the head of the waiting queue is read")
        seqs, visible = self.seqs, self._visible
        while self.start < len(seqs) and not visible(seqs[self.start]):
            self.start += 1
        if self.start == len(seqs):
            raise IndexError("no waiting sequence is left")
        return seqs[self.start]

    def __bool__(self) -> bool:
        try:
            self[0]
        except IndexError:
            return False
        return True
