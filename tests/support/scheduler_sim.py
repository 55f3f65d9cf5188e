"""A worker stand-in for scheduler tests: it applies every SchedulerOutput with the real
workers' ``apply_output`` (protocol/step_state.py), models the *contents* of every KV slot, and fails loudly when a sequence
would attend over a slot holding anything but its own KV or zeros.

Each device/host block is a list of slots. A slot is ``STALE`` (whatever an earlier
owner left: the NaN of vLLM #35219), ``ZERO``, or ``(position, token)`` once written (a
speculative proposal's slot: ``Draft(seq, position, token)``, which may stay behind its
sequence's end once rejected: finite KV the attention masks, never stale).
Cache operations run in the protocol's order: swap out, swap in, copy (gather, then
scatter), zero; then every scheduled request writes its computed slots, and then each
one reads every slot of its block table: positions it has computed must hold its own
``(position, token)``, the rest of its last block must be ZERO.

A hybrid model's local tables (``SchedulerConfig.num_window_groups``) are written and read the same
way, each within its window, their slots tagged with their group (``(position, token, group)``), so
a block that reaches another group's table without being zeroed or refilled is caught.

``drafter`` stands in for a draft model (``draft_model``): asked by ``SchedulerOutput.draft_tokens``,
it proposes after an entry's sample from the entry's tokens so far, as the real worker's does.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from pagedserve.protocol.messages import AddRequest, SamplingParams, SchedulerOutput, StepResult
from pagedserve.protocol.step_state import StepContractError, apply_output, note_accepted, note_samples

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.request import Sequence
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.scheduler_proc.step import StepOutputs

STALE = "stale"
ZERO = "zero"
EOS = 2


class Draft(NamedTuple):
    """A slot written for a speculative proposal of ``seq``."""
    seq: str
    position: int
    token: int


def _written(position: int, token: int, group: int) -> tuple:
    return (position, token) if group == 0 else (position, token, group)


def _holds(slot, position: int, token: int, group: int = 0) -> bool:
    return slot == _written(position, token, group) or (isinstance(slot, Draft) and slot[1:] == (position, token))


class WorkerModelError(AssertionError):
    """The scheduler's output would make a real worker compute the wrong thing."""


@dataclass
class SimWorker:
    config: SchedulerConfig
    next_token: Callable[[str, list[int]], int]
    device: list = field(init=False)
    host: list = field(init=False)
    held: dict = field(default_factory=dict)
    zero_events: list = field(default_factory=list)  # (step, block)
    # (req_id, tokens including the new sample, k) -> up to k proposals; None: no draft model
    drafter: Optional[Callable[[str, list[int], int], list[int]]] = None

    def __post_init__(self) -> None:
        bs = self.config.block_size
        self.device = [[STALE] * bs for _ in range(self.config.num_gpu_blocks)]
        self.host = [[STALE] * bs for _ in range(self.config.num_cpu_blocks)]

    def step(self, out: SchedulerOutput) -> StepResult:
        bs = self.config.block_size
        for req_id in out.finished_req_ids:
            if req_id not in self.held:
                raise WorkerModelError(f"step {out.step}: told to forget unknown {req_id!r}")
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
        gathered = [list(self.device[src]) for src, _ in out.blocks_to_copy]
        dsts = [dst for _, dst in out.blocks_to_copy]
        if len(set(dsts)) != len(dsts):
            raise WorkerModelError(f"step {out.step}: two copies into one block {dsts}")
        for (_, dst), content in zip(out.blocks_to_copy, gathered):
            self.device[dst] = content
        zero = out.new_block_ids_to_zero
        if len(set(zero)) != len(zero):
            raise WorkerModelError(f"step {out.step}: a block listed twice for zeroing: {zero}")
        for block in zero:
            self.device[block] = [ZERO] * bs
            self.zero_events.append((out.step, block))

        try:
            batch = apply_output(self.held, out)
        except StepContractError as exc:
            raise WorkerModelError(str(exc)) from None
        if len(batch) != len({held.req_id for held in batch}):
            raise WorkerModelError(f"step {out.step}: a request is scheduled twice")

        total = 0
        drafts = out.spec_token_ids
        for held in batch:  # write phase
            req_id, computed, scheduled = held.req_id, held.num_computed_tokens, held.num_scheduled_tokens
            end = computed + scheduled
            proposed = drafts.get(req_id, [])
            if scheduled < 1:
                raise WorkerModelError(f"step {out.step}: {req_id} schedules [{computed}, {end})")
            if len(held.block_ids) * bs < end + len(proposed):
                raise WorkerModelError(f"step {out.step}: {req_id} has {len(held.block_ids)} blocks for "
                                       f"{end + len(proposed)} tokens")
            if proposed and not held.samples:
                raise WorkerModelError(f"step {out.step}: proposals for {req_id}, which does not sample")
            for group, table in enumerate([held.block_ids, *held.window_tables]):
                for pos in range(computed, end):
                    self.device[table[pos // bs]][pos % bs] = _written(pos, held.token_ids[pos], group)
                for j, token in enumerate(proposed):
                    self.device[table[(end + j) // bs]][(end + j) % bs] = Draft(req_id, end + j, token)
            total += scheduled + len(proposed)
        if total != out.total_num_scheduled_tokens:
            raise WorkerModelError(f"step {out.step}: total {out.total_num_scheduled_tokens} != {total}")

        unknown = set(out.draft_tokens) - {held.req_id for held in batch}
        if unknown:
            raise WorkerModelError(f"step {out.step}: draft tokens for {sorted(unknown)}, not entries of the step")
        req_ids, sampled, sampling, accepted, proposals = [], [], [], {}, {}
        for held in batch:  # attention phase
            req_id = held.req_id
            proposed = drafts.get(req_id, [])
            tokens = held.token_ids + proposed
            end = held.num_computed_tokens + held.num_scheduled_tokens + len(proposed)
            for group, table in enumerate([held.block_ids, *held.window_tables]):
                # a query at q reads keys from q - window + 1 on
                window = self.config.sliding_window if group == 0 else self.config.hybrid_window
                first = max(0, held.num_computed_tokens - window + 1) if window else 0
                for pos in range(first, len(table) * bs):
                    slot = self.device[table[pos // bs]][pos % bs]
                    ok = _holds(slot, pos, tokens[pos], group) if pos < end else (
                        slot == ZERO or (isinstance(slot, Draft) and slot.seq == req_id))
                    if not ok:
                        want = _written(pos, tokens[pos], group) if pos < end else ZERO
                        raise WorkerModelError(
                            f"step {out.step}: {req_id} reads {slot!r} at position {pos} "
                            f"(block {table[pos // bs]} of group {group}), expected {want!r}")
            if held.samples:
                req_ids.append(req_id)
                context = list(held.token_ids)
                token = self.next_token(req_id, context)
                num_accepted = 0
                while num_accepted < len(proposed) and token == proposed[num_accepted]:
                    context.append(token)
                    num_accepted += 1
                    token = self.next_token(req_id, context)
                if req_id in drafts:
                    accepted[req_id] = num_accepted
                sampled.append(token)
                sampling.append(held)
                if self.drafter is not None and out.draft_tokens.get(req_id):
                    proposals[req_id] = self.drafter(req_id, context + [token], out.draft_tokens[req_id])
        note_accepted(self.held, accepted, bs)
        note_samples(sampling, sampled)
        return StepResult(step=out.step, rank=0, req_ids=req_ids, sampled_token_ids=sampled,
                          logprobs=[-0.5] * len(sampled), num_accepted_tokens=accepted,
                          draft_token_ids=proposals)


def counting_tokens() -> Callable[[str, list[int]], int]:
    """Never EOS: the token is 1000 + the sequence's length, so each position's token is known."""
    def next_token(req_id: str, tokens: list[int]) -> int:
        return 1000 + len(tokens)
    return next_token


def random_tokens(rng: random.Random, eos_probability: float) -> Callable[[str, list[int]], int]:
    def next_token(req_id: str, tokens: list[int]) -> int:
        return EOS if rng.random() < eos_probability else rng.randrange(10, 1000)
    return next_token


def step_clock(seconds_per_call: float = 0.001) -> Callable[[], float]:
    """A scheduler clock that advances the same amount at every read: with it every step's
    cycle looks alike, so speculation's measured cost (scheduler_proc/spec_cost.py) is the same
    on every run of a test, whatever the machine's speed."""
    calls = iter(range(1 << 62))
    return lambda: seconds_per_call * next(calls)


def request(request_id: str, prompt: list[int], max_tokens: int = 8, **sampling) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=prompt,
                      sampling=SamplingParams(max_tokens=max_tokens, **sampling), eos_token_ids=[EOS])


class StepDriver:
    """The engine loop's order of calls, without processes: with ``ahead``, the next step is
    scheduled (and queued for the worker) before the current one's result is applied, as
    ``--async-scheduling`` does, whenever the scheduler allows it."""

    def __init__(self, sched: Scheduler, worker: SimWorker, ahead: bool = False):
        self.sched, self.worker, self.ahead = sched, worker, ahead
        self.pending: deque[SchedulerOutput] = deque()
        self.steps_ahead = 0  # steps scheduled while another was out
        self.on_schedule: Optional[Callable[[SchedulerOutput], None]] = None
        self.timed_out: list = []  # deltas of requests a schedule() ended by a time limit (the engine sends them)

    def busy(self) -> bool:
        return self.sched.has_unfinished() or bool(self.pending)

    def step(self) -> tuple[SchedulerOutput, StepResult, StepOutputs]:
        """One turn: schedule (and maybe schedule ahead), then apply the oldest step's result."""
        sched, pending = self.sched, self.pending
        if not pending:
            self._schedule()
        if self.ahead and len(pending) == 1 and sched.has_unfinished() and sched.can_schedule_ahead():
            self._schedule()
            self.steps_ahead += 1
        out = pending.popleft()
        result = self.worker.step(out)
        return out, result, sched.update_from_output(out, result)

    def _schedule(self) -> None:
        out = self.sched.schedule()
        self.timed_out.extend(self.sched.take_timed_out())
        if self.on_schedule is not None:
            self.on_schedule(out)
        self.pending.append(out)


def run_until_done(sched: Scheduler, worker: SimWorker, max_steps: int = 10_000,
                   on_step: Optional[Callable] = None, ahead: bool = False) -> list:
    """Steps until nothing is unfinished; returns every delta. ``on_step(out, result, deltas)``."""
    deltas = []
    driver = StepDriver(sched, worker, ahead)
    for _ in range(max_steps):
        if not driver.busy():
            return deltas
        out, result, step_deltas = driver.step()
        deltas.extend(driver.timed_out)
        driver.timed_out.clear()
        deltas.extend(step_deltas)
        if on_step is not None:
            on_step(out, result, step_deltas)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.stats()}")


def swap_one_out(sched: Scheduler, worker: SimWorker) -> Sequence:
    """Three requests of 7 prompt tokens and 8 to generate ("old", "mid", "new"), stepped until one
    is swapped out (8 device blocks of 4 tokens, preemption by swap); that sequence, its step applied."""
    for rid in ("old", "mid", "new"):
        sched.add_request(request(rid, list(range(30, 37)), max_tokens=8, ignore_eos=True))
    while not sched.swapped:
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    return sched.swapped[0]


def swap_one_back_in(sched: Scheduler, worker: SimWorker) -> Sequence:
    """Three requests of 7 prompt tokens and 8 to generate, stepped until one swapped out comes
    back in (a cache too small for all three, preemption by swap); that sequence, its step applied."""
    for rid, first in (("old", 30), ("mid", 40), ("new", 50)):
        sched.add_request(request(rid, list(range(first, first + 7)), max_tokens=8, ignore_eos=True))
    while True:
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
        if out.blocks_to_swap_in:
            back = {block for _, block in out.blocks_to_swap_in}
            (seq,) = [seq for seq in sched.running.in_order() if back & {*seq.block_ids}]
            return seq


def assert_all_blocks_free(sched: Scheduler) -> None:
    device, host = sched.bm.device, sched.bm.host
    reserved = sched.bm.frees_behind_window  # the null block behind a sliding window stays the manager's
    assert device.num_free == device.num_blocks - reserved, sched.stats()
    assert host.num_free == host.num_blocks, sched.stats()
    assert sum(device.ref_counts) == reserved and not any(host.ref_counts)


def scripted(*tokens):
    """Every sequence samples ``tokens`` in order, then 500, 501, ..."""
    def next_token(req_id, held_tokens, _counts={}):
        i = _counts.get(req_id, 0)
        _counts[req_id] = i + 1
        return tokens[i] if i < len(tokens) else 500 + i
    return next_token


def assert_null_block_untouched(sched, worker) -> None:
    """A windowed scheduler's null block (what freed table entries name) was never handed out, zeroed,
    written or swapped into."""
    null = sched.bm.null_block
    assert all(block != null for _, block in worker.zero_events)
    assert set(worker.device[null]) == {"stale"}


def tokens_by_request(deltas) -> dict:
    """Each request's generated token ids, in order, from a run's deltas (none may finish by a stop)."""
    tokens: dict = {}
    for delta in deltas:
        assert delta.finish_reason in (None, "length"), delta
        tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens
