"""Which sequence starts next and which running one gives way: the scheduling policy.

The scheduler asks these questions and applies the answers; everything else (budgets,
blocks, swap or recompute) is the same under every policy. A policy only reads the queues.

First come, first served (``fcfs``, the default, and the seed workloads' rule): swapped
sequences come back oldest first, then the oldest waiting sequence is admitted and nothing
overtakes it; under memory pressure the newest running sequence is preempted, so the oldest
is never starved (shared/seeds 001).

``priority``: every order is by (level, arrival), level being the request's priority (lower
first, vLLM's convention), lifted one level per ``priority_aging_s`` since its arrival when
aging is on. Within one level this is exactly FCFS. A swapped or recompute-preempted sequence
keeps its arrival, so it comes back before any newer one of its level. The victim is the
newest running sequence of the worst level present. A waiting (or swapped) sequence that does
not fit preempts running ones of a strictly worse level, before the step's batch is built
(``victim_for_waiting``): nothing is scheduled yet, so no victim has to be taken back out of
a batch, and the freed blocks carry no copy or zero listed in the same step.

``deadline``: as ``priority``, but within one level the earliest urgency first (deadlines.py:
the first-token limit, else arrival + ``--default-deadline-s``), so without limits it is FCFS
within a level. ``fair``: fair_share.py.

Time: ``now`` is the clock of the step being scheduled, set by the scheduler (deadlines.py), so
aging replays bit for bit. The hooks (``arrived``, ``closed``, ``admitted``, ``sampled``) let a
policy keep its own accounts (fair share's counters); they change no queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence as Queue

from pagedserve.scheduler_proc import admission
from pagedserve.scheduler_proc.request import SWAPPED

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.config import SchedulerConfig
    from pagedserve.scheduler_proc.request import Request, Sequence
    from pagedserve.scheduler_proc.running import RunningSequences
    from pagedserve.scheduler_proc.scheduler import Scheduler


class FcfsPolicy:
    name = "fcfs"
    now = 0.0  # the clock of the step being scheduled (set by the scheduler)

    def arrived(self, request: "Request") -> None:
        """``request`` was accepted (before its first step)."""

    def closed(self, request: "Request") -> None:
        """``request`` ended, for any reason."""

    def admitted(self, seq: "Sequence") -> None:
        """``seq`` was admitted from the waiting queue (a recomputed one too)."""

    def sampled(self, outputs, requests: dict[str, "Request"]) -> None:
        """A step's tokens came in (``outputs``: its StepOutputs)."""

    def service(self) -> dict[str, float]:
        """Each tenant's virtual token counter (fair share); {}: the policy keeps none."""
        return {}

    def running_order(self, seqs: list["Sequence"]) -> list["Sequence"]:
        """The order the running loop gives out tokens and blocks in (``seqs``: arrival order)."""
        return seqs

    def next_to_start(self, swapped: Queue["Sequence"], waiting: Queue["Sequence"]) -> Optional["Sequence"]:
        """The swapped or waiting sequence to try next, or None; the first that does not fit
        stops the rest, so nothing overtakes it. The older of the two queues' heads: a sequence
        preempted by recomputation waits, and a newer one swapped out must not resume before it."""
        heads = [queue[0] for queue in (swapped, waiting) if queue]
        return min(heads, key=lambda seq: seq.order) if heads else None

    def victim(self, running: "RunningSequences") -> "Sequence":
        """The running sequence to preempt when blocks run out (``running`` is not empty): the
        one asking for blocks, or one the step has not scheduled yet (the running loop goes
        oldest first, so the newest qualifies)."""
        return running.newest()

    def victim_for_waiting(self, sched: "Scheduler") -> Optional["Sequence"]:
        """A running sequence to preempt before the step, for a waiting one that outranks it."""
        return None


class PriorityPolicy(FcfsPolicy):
    name = "priority"

    def __init__(self, aging_s: Optional[float] = None):
        self.aging_s = aging_s

    def _level(self, now: float) -> Callable[["Sequence"], int]:
        aging_s = self.aging_s
        if aging_s is None:
            return lambda seq: seq.request.priority
        return lambda seq: seq.request.priority - int((now - seq.request.arrival_time) // aging_s)

    def _key(self) -> Callable[["Sequence"], tuple]:
        level = self._level(self.now)
        return lambda seq: (level(seq), seq.order)

    def running_order(self, seqs: list["Sequence"]) -> list["Sequence"]:
        # Best level first: whoever the running loop then preempts (the worst level's newest)
        # is never one it has already scheduled.
        return sorted(seqs, key=self._key())

    def next_to_start(self, swapped: Queue["Sequence"], waiting: Queue["Sequence"]) -> Optional["Sequence"]:
        if not swapped and not waiting:
            return None
        key = self._key()
        best = [min(queue, key=key) for queue in (swapped, waiting) if queue]
        return min(best, key=key)

    def victim(self, running: "RunningSequences") -> "Sequence":
        return running.max_by(self._key())

    def victim_for_waiting(self, sched: "Scheduler") -> Optional["Sequence"]:
        if not len(sched.running):
            return None
        key = self._key()
        candidate = self.next_to_start(sched.swapped, sched.waiting)
        if candidate is None or fits_now(sched, candidate) or sched.lora_must_wait(candidate):
            return None  # (one waiting for a LoRA slot would not start for the blocks a victim frees)
        victim = sched.running.max_by(key)  # a scan of the running set: only when one waits
        return victim if key(victim)[0] > key(candidate)[0] else None


def fits_now(sched: "Scheduler", seq: "Sequence") -> bool:
    """Whether ``seq`` could start in a step whose running decodes each take one token."""
    if sched.seats_free() < admission.seats_needed(seq):
        return False
    config = sched.config
    budget = max(1, config.max_num_batched_tokens - len(sched.running))
    if seq.status == SWAPPED:
        return admission.tokens_to_resume(seq, sched.bm, budget, config.enable_chunked_prefill) > 0
    return admission.plan_admission(seq, sched.bm, config, budget, len(sched.running),
                                    admission.window_growth(config, sched.running)) is not None


class DeadlinePolicy(PriorityPolicy):
    name = "deadline"

    def _key(self) -> Callable[["Sequence"], tuple]:
        level = self._level(self.now)
        return lambda seq: (level(seq), seq.request.urgency, seq.order)


def policy_for(config: "SchedulerConfig"):
    name = config.scheduling_policy
    if name == "fair":
        from pagedserve.scheduler_proc.fair_share import FairPolicy
        return FairPolicy(config.tenant_weights)
    if name in ("priority", "deadline"):
        return (PriorityPolicy if name == "priority" else DeadlinePolicy)(config.priority_aging_s)
    return FcfsPolicy()
