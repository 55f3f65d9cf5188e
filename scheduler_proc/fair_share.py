"""Fair share per tenant (``--scheduling-policy fair``): the virtual token counter (VTC) of Sheng
et al., "Fairness in Serving Large Language Models" (OSDI '24).

Each tenant (``AddRequest.tenant``; "" for a request that names none) has a counter of the
service it received: prompt tokens weigh 1, charged when its request is first admitted, and
generated tokens weigh 2, charged as they come in (the paper's weights: a generated token
costs a step of its own), each divided by the tenant's ``--tenant-weights`` weight (default 1).

- The next to start is the oldest swapped or waiting sequence of the tenant whose counter is
  least. Within one tenant this is FCFS (a swapped one before newer waiting ones), and with one
  tenant exactly FCFS: a lone tenant gets the whole machine.
- A tenant that arrives with nothing in the scheduler, and had nothing for over a second, is
  lifted to the least counter of the tenants that have something (with none, to the counter of
  the last tenant that left), so idle time banks no credit and a tenant that floods is held back
  only while others wait; a shorter gap is a client between two requests, not idleness.
- When blocks run out, the victim is the newest running sequence of the tenant served most;
  the running loop goes least served first, so that victim is never already in the step.
  A waiting request of the least-served tenant that cannot start preempts that victim before
  the step, but only while its tenant is behind by more than the request's whole cost, so two
  tenants never take a seat back and forth.
- Counters of tenants that left are forgotten once the lift would restore them anyway, and
  past 64 absent ones all of them, so memory follows the tenants present, not every one seen.

Priorities are refused under ``fair`` (protocol/priority.py): one order, the counters'.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable, Optional, Sequence as Queue

from pagedserve.protocol.priority import parse_tenant_weights
from pagedserve.scheduler_proc.policy import FcfsPolicy, fits_now

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Request, Sequence
    from pagedserve.scheduler_proc.running import RunningSequences
    from pagedserve.scheduler_proc.scheduler import Scheduler

PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0
MAX_ABSENT = 64  # counters of tenants with nothing in the scheduler kept beyond those present
# A tenant back within this many seconds was not idle, only between requests (a client's round
# trip): it keeps its counter, and so what it is owed. Measured: without it a closed-loop tenant
# dropped to zero requests between rounds, was lifted each time, and got 19% instead of 50%.
IDLE_GRACE_S = 1.0


class FairPolicy(FcfsPolicy):
    name = "fair"

    def __init__(self, weights: Optional[str] = None):
        self.weights = parse_tenant_weights(weights) if weights else {}
        self.counters: dict[str, float] = {}  # the tenants present, and those that left served more
        self._live: dict[str, int] = {}  # requests in the scheduler per tenant (tenants with none absent)
        self._tenant_of: dict[str, str] = {}  # request id -> tenant, for the tokens of a step
        self._gone: list[str] = []  # closed since the last step's tokens were charged
        self._last_left = 0.0
        self._left_at: dict[str, float] = {}  # tenants with nothing in the scheduler: since when
        self._last_ids: list = []  # the last step's token request ids, and their count per tenant
        self._last_counts: Counter = Counter()

    def _charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)

    def _floor(self) -> float:
        counters = self.counters
        return min(counters.get(t, 0.0) for t in self._live) if self._live else self._last_left

    # ------------------------------------------------------------------ accounts

    def arrived(self, request: "Request") -> None:
        tenant = request.tenant
        left_at = self._left_at.pop(tenant, None)
        if tenant not in self._live and (left_at is None or self.now - left_at > IDLE_GRACE_S):
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self._floor())
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self._tenant_of[request.request_id] = tenant

    def closed(self, request: "Request") -> None:
        tenant = request.tenant
        self._gone.append(request.request_id)  # its last step's tokens may still be charged
        left = self._live[tenant] - 1
        if left:
            self._live[tenant] = left
            return
        del self._live[tenant]
        self._last_left = self.counters.get(tenant, 0.0)
        self._left_at[tenant] = self.now
        if len(self.counters) > 2 * len(self._live) + MAX_ABSENT:
            self._forget_absent()

    def _forget_absent(self) -> None:
        """Drop the counters of absent tenants, first those idle past the grace whom the lift would
        restore anyway, then (still too many) all: memory stays bounded, at the price of forgetting
        who was served more long ago."""
        floor, now, live = self._floor(), self.now, self._live
        self.counters = {t: c for t, c in self.counters.items()
                         if t in live or c > floor or now - self._left_at.get(t, now) <= IDLE_GRACE_S}
        if len(self.counters) > 2 * len(live) + MAX_ABSENT:
            self.counters = {t: c for t, c in self.counters.items() if t in live}
        self._left_at = {t: at for t, at in self._left_at.items() if t in self.counters}

    def admitted(self, seq: "Sequence") -> None:
        self._charge(seq.request.tenant, PROMPT_WEIGHT * seq.request.num_prompt_tokens)

    def sampled(self, outputs, requests: dict[str, "Request"]) -> None:
        tenant_of = self._tenant_of
        ids = outputs.token_request_ids
        if len(self._live) == 1 and not self._gone:  # one tenant: no lookups
            (tenant,) = self._live
            self._charge(tenant, OUTPUT_WEIGHT * (len(ids) + sum(len(d.new_token_ids) for d in outputs.deltas)))
            return
        if ids is not self._last_ids:  # the decode lane hands out the same list while it is unchanged
            self._last_ids, self._last_counts = ids, Counter(map(tenant_of.get, ids))
        counts = self._last_counts.copy()
        for delta in outputs.deltas:
            if delta.new_token_ids:
                counts[tenant_of.get(delta.request_id)] += len(delta.new_token_ids)
        for tenant, tokens in counts.items():
            if tenant is not None and (tenant in self._live or tenant in self.counters):
                self._charge(tenant, OUTPUT_WEIGHT * tokens)
        for request_id in self._gone:
            tenant_of.pop(request_id, None)
        self._gone.clear()

    def service(self) -> dict[str, float]:
        return {tenant: self.counters.get(tenant, 0.0) for tenant in self._live}

    # ------------------------------------------------------------------ order

    def _key(self) -> Callable[["Sequence"], tuple[float, int]]:
        counters = self.counters
        return lambda seq: (counters.get(seq.request.tenant, 0.0), seq.order)

    def running_order(self, seqs: list["Sequence"]) -> list["Sequence"]:
        return seqs if len(self._live) <= 1 else sorted(seqs, key=self._key())

    def next_to_start(self, swapped: Queue["Sequence"], waiting: Queue["Sequence"]) -> Optional["Sequence"]:
        """The oldest swapped-or-waiting sequence of the least-served tenant: a swapped one resumes
        before its tenant's newer waiting ones, not before another tenant that is owed more (else a
        victim swapped out for a waiting tenant would take its seat straight back)."""
        if len(self._live) <= 1:
            return swapped[0] if swapped else (waiting[0] if waiting else None)
        counters, num_tenants = self.counters, len(self._live)
        heads: dict[str, "Sequence"] = {}
        for queue in (swapped, waiting):
            first: dict[str, "Sequence"] = {}
            for seq in queue:  # arrival order: each tenant's first is its oldest
                first.setdefault(seq.request.tenant, seq)
                if len(first) == num_tenants:
                    break
            for tenant, seq in first.items():
                if tenant not in heads or seq.order < heads[tenant].order:
                    heads[tenant] = seq
        if not heads:
            return None
        return min(heads.values(), key=lambda seq: (counters.get(seq.request.tenant, 0.0), seq.order))

    def victim(self, running: "RunningSequences") -> "Sequence":
        return running.newest() if len(self._live) <= 1 else running.max_by(self._key())

    def victim_for_waiting(self, sched: "Scheduler") -> Optional["Sequence"]:
        """The newest running sequence of the tenant served most, when the least-served tenant's
        next request cannot start and that tenant is behind by more than the whole request would
        cost it: after it, it is still not ahead, so the other cannot take the seat straight back."""
        if len(self._live) <= 1 or not len(sched.running):
            return None
        candidate = self.next_to_start(sched.swapped, sched.waiting)
        if candidate is None or fits_now(sched, candidate) or sched.lora_must_wait(candidate):
            return None  # (one waiting for a LoRA slot would not start for the blocks a victim frees)
        victim = sched.running.max_by(self._key())  # a scan of the running set: only when one waits
        request, counters = candidate.request, self.counters
        cost = (PROMPT_WEIGHT * request.num_prompt_tokens + OUTPUT_WEIGHT * request.sampling.max_tokens) \
            / self.weights.get(request.tenant, 1.0)
        behind = counters.get(victim.request.tenant, 0.0) - counters.get(request.tenant, 0.0)
        return victim if victim.request.tenant != request.tenant and behind > cost else None
