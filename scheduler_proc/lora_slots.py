"""LoRA adapters on the scheduler's side: the registered adapters, the workers' ``--max-loras``
device slots they occupy, and each step's changes for the workers (``LoRAStep``).

Slots. Every admitted sequence of an adapter (running, or swapped out: it comes back with the
same slot) holds a reference on the slot its adapter occupies; a slot with references is never
given to another adapter, because the workers compute that sequence with the weights in it. A
sequence that needs a slot takes the one its adapter already occupies (referenced or not: no
reload), else the least recently used free one (no references), which the step's ``loads`` fill.
A recompute-preempted, finished or aborted sequence drops its reference.

Waiting for a slot, never starving. When every slot is referenced, a waiting request of another
adapter cannot start; requests behind it whose adapter is resident (or the base model) still
start, so one adapter's queue does not hold the others' up. That alone could starve it: resident
adapters under steady load never let their slot's references fall to zero. So while a request
waits for a slot, one resident adapter is *drained*: no new sequence of it starts (its running
ones finish as usual) until its slot frees and a waiting adapter is loaded into it. The drained
one is the least recently admitted adapter: the one with the least demand, and never the one just
loaded (draining the adapter with the fewest references instead picked the newcomer, which had one,
and cut every residency short: 161 of 256 seats ran, against 252, in
bench/scripts/lora_scheduler_bench.py). The choice holds until a load, so the wait is bounded by
that adapter's longest running generation. The queue is taken in the policy's order, so the
oldest (FCFS) waiting request takes the slot that frees: first come, first served within the limit.
A slot is never a reason to preempt (policy.py): a victim's blocks would not start the waiting one.

Registry. ``LoadLoRA`` registers (or, with another digest, replaces) an adapter under its name;
a request binds the adapter registered at its arrival. ``UnloadLoRA`` forgets the name at once
for new requests, but the workers are told to ``forget`` it only once no open request is bound
to it, so nothing in flight loses its weights (the frontend unloads only idle adapters anyway).

The scheduler owns one of these and is its only caller; this object is the only writer of the
slot table, the references and ``Sequence.lora_slot``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

from pagedserve.protocol.messages import AddRequest, LoRAAdapter, LoRASlot, LoRAStep

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Sequence

NO_SLOT = -1


def lora_refusal(msg: AddRequest, enabled: bool, registered: dict[str, LoRAAdapter]) -> Optional[str]:
    """Why ``msg``'s ``lora_name`` cannot be served, or None (also for the base model)."""
    name = msg.lora_name
    if not name:
        return None
    if not enabled:
        return f"LoRA adapter {name!r} requested, but LoRA is not enabled on this server (--enable-lora)"
    if name not in registered:
        return (f"LoRA adapter {name!r} is not loaded (load it with --lora-modules or "
                f"POST /v1/load_lora_adapter)")
    if msg.pooling is not None:
        return f"LoRA adapter {name!r}: embedding requests are computed by the base model only"
    return None


def unloaded_message(name: str) -> str:
    return f"LoRA adapter {name!r} was unloaded before the request started"


class LoRASlots:
    def __init__(self, max_loras: int):
        self.registered: dict[str, LoRAAdapter] = {}  # by name, in registration order
        self.slot_adapter: list[Optional[LoRAAdapter]] = [None] * max_loras  # what each slot holds
        self.slot_refs: list[int] = [0] * max_loras  # admitted sequences computed with it
        self._slot_used: list[int] = [-1] * max_loras  # when a reference was last taken (LRU); -1: never
        self._clock = 0
        self._open: Counter = Counter()  # adapter -> open requests bound to it
        self.draining = NO_SLOT  # the slot whose adapter starts nothing new while another waits
        # The next LoRAStep's changes: slot -> adapter loaded (the latest wins), name -> adapter
        # to read ahead, names to drop, and the step's new requests' slots (set per step).
        self._loads: dict[int, LoRAAdapter] = {}
        self._prefetch: dict[str, LoRAAdapter] = {}
        self._forget: list[str] = []
        self._request_slots: dict[str, int] = {}

    # ------------------------------------------------------------------ registry

    def register(self, adapter: LoRAAdapter) -> Optional[LoRAAdapter]:
        """Registers ``adapter``; returns the one it replaces under that name (another digest), if any."""
        old = self.registered.get(adapter.name)
        if old == adapter:
            return None
        self.registered[adapter.name] = adapter
        self._prefetch[adapter.name] = adapter
        if adapter.name in self._forget:  # unloaded and loaded again before a step told the workers
            self._forget.remove(adapter.name)
        if old is not None:
            self._retire_if_idle(old)
        return old

    def unregister(self, name: str) -> Optional[LoRAAdapter]:
        """Forgets ``name`` for new requests; returns its adapter (None: not registered)."""
        old = self.registered.pop(name, None)
        if old is not None:
            self._prefetch.pop(name, None)
            self._retire_if_idle(old)
        return old

    def bind(self, adapter: LoRAAdapter) -> None:
        """A request of ``adapter`` was accepted: its adapter stays usable until it closes."""
        self._open[adapter] += 1

    def closed(self, adapter: LoRAAdapter) -> None:
        """A request bound to ``adapter`` ended."""
        left = self._open[adapter] - 1
        if left:
            self._open[adapter] = left
            return
        del self._open[adapter]
        self._retire_if_idle(adapter)

    def _retire_if_idle(self, adapter: LoRAAdapter) -> None:
        """An adapter no longer registered and bound to no open request leaves its slot; the
        workers forget its name unless the name now belongs to a replacement (whose prefetch and
        loads carry the new digest)."""
        if self._open[adapter] or self.registered.get(adapter.name) == adapter:
            return
        del self._open[adapter]
        for slot, held in enumerate(self.slot_adapter):
            if held == adapter:
                self.slot_adapter[slot] = None
                self._slot_used[slot] = -1
                self._loads.pop(slot, None)
                if slot == self.draining:
                    self.draining = NO_SLOT
        if adapter.name not in self.registered and adapter.name not in self._forget:
            self._forget.append(adapter.name)

    # ------------------------------------------------------------------ slots

    def _slot_for(self, adapter: LoRAAdapter) -> int:
        """The slot ``adapter`` would use: the one holding it, else the least recently used free
        one (an empty slot counts as never used); NO_SLOT when every slot is referenced."""
        best, best_used = NO_SLOT, None
        for slot, held in enumerate(self.slot_adapter):
            if held == adapter:
                return slot
            if self.slot_refs[slot] == 0 and (best_used is None or self._slot_used[slot] < best_used):
                best, best_used = slot, self._slot_used[slot]
        return best

    def must_wait(self, adapter: LoRAAdapter) -> bool:
        """Whether a new sequence of ``adapter`` cannot start now: it is being drained, or no slot
        holds it and none is free. A pure question (the priority policies ask it too)."""
        slot = self._slot_for(adapter)
        return slot == NO_SLOT or (self.draining != NO_SLOT and self.slot_adapter[self.draining] == adapter)

    def hold_back(self, adapter: LoRAAdapter) -> None:
        """``adapter``'s next sequence waits (``must_wait``); when for want of a slot, choose the
        resident adapter to drain if none is draining yet: the least recently admitted."""
        if self.draining != NO_SLOT or self._slot_for(adapter) != NO_SLOT:
            return
        slots = range(len(self.slot_adapter))
        self.draining = min(slots, key=lambda slot: self._slot_used[slot])

    def pass_complete(self, held: set[LoRAAdapter]) -> None:
        """An admission pass went through every queue, holding back ``held``'s sequences: when none
        of them waits for want of a slot (only the drained one's), the drain has no one to serve."""
        if self.draining != NO_SLOT and all(self._slot_for(adapter) != NO_SLOT for adapter in held):
            self.draining = NO_SLOT

    def acquire(self, seq: "Sequence", adapter: LoRAAdapter) -> None:
        """``seq`` (admitted; ``must_wait`` was just answered no) references its adapter's slot,
        loading the adapter into a free one when it holds none."""
        slot = self._slot_for(adapter)
        if slot == NO_SLOT:
            raise RuntimeError(f"{seq.seq_id}: no slot for LoRA adapter {adapter.name!r} (must_wait said yes)")
        if self.slot_adapter[slot] != adapter:
            self.slot_adapter[slot] = adapter
            self._loads[slot] = adapter
            self.draining = NO_SLOT  # the drain served a waiting adapter; the next one that waits picks again
        self._take(seq, slot)

    def share(self, seq: "Sequence", slot: int) -> None:
        """A forked child references its parent's slot."""
        self._take(seq, slot)

    def _take(self, seq: "Sequence", slot: int) -> None:
        self.slot_refs[slot] += 1
        self._clock += 1
        self._slot_used[slot] = self._clock
        seq.lora_slot = slot

    def release(self, seq: "Sequence") -> None:
        """``seq`` (holding a slot) ended or went back to waiting."""
        self.slot_refs[seq.lora_slot] -= 1
        seq.lora_slot = NO_SLOT

    # ------------------------------------------------------------------ the workers

    def step_planned(self, request_slots: dict[str, int]) -> None:
        """The slots of the step's new requests that use an adapter (StepPlan.request_slots)."""
        self._request_slots = request_slots

    def has_changes(self) -> bool:
        return bool(self._loads or self._prefetch or self._forget)

    def take_step(self, step: int) -> Optional[LoRAStep]:
        """The changes since the last LoRAStep, for step ``step``; None when there are none."""
        if not (self._loads or self._prefetch or self._forget or self._request_slots):
            return None
        msg = LoRAStep(step, [LoRASlot(slot, adapter) for slot, adapter in sorted(self._loads.items())],
                       list(self._prefetch.values()), self._forget, self._request_slots)
        self._loads, self._prefetch, self._forget, self._request_slots = {}, {}, [], {}
        return msg

    def workers_replaced(self) -> None:
        """Every request ended (the workers died, ``Scheduler.fail_all``) and fresh workers hold no
        adapter: the next LoRAStep re-sends every registered adapter and every occupied slot's load."""
        self.slot_refs = [0] * len(self.slot_refs)
        self.draining = NO_SLOT
        self._forget, self._request_slots = [], {}
        self._prefetch = dict(self.registered)
        self._loads = {slot: adapter for slot, adapter in enumerate(self.slot_adapter) if adapter is not None}

    # ------------------------------------------------------------------ debugging

    def check(self, admitted: list["Sequence"], running: list["Sequence"], waiting, fail) -> None:
        """References against the admitted (running and swapped) sequences (invariants.py)."""
        refs = [0] * len(self.slot_refs)
        for seq in admitted:
            adapter = seq.request.lora
            if adapter is None:
                if seq.lora_slot != NO_SLOT:
                    fail(f"{seq.seq_id} of the base model holds LoRA slot {seq.lora_slot}")
                continue
            if seq.lora_slot == NO_SLOT:
                fail(f"{seq.seq_id} of LoRA adapter {adapter.name!r} is admitted without a slot")
            if self.slot_adapter[seq.lora_slot] != adapter:
                fail(f"{seq.seq_id} of LoRA adapter {adapter.name!r} references slot {seq.lora_slot}, "
                     f"which holds {getattr(self.slot_adapter[seq.lora_slot], 'name', None)!r}")
            refs[seq.lora_slot] += 1
        if refs != self.slot_refs:
            fail(f"LoRA slot references {self.slot_refs} disagree with the admitted sequences' {refs}")
        held = [adapter for adapter in self.slot_adapter if adapter is not None]
        if len(held) != len(set(held)):
            fail(f"a LoRA adapter occupies two slots: {[a.name for a in held]}")
        for seq in running:
            if seq.request.lora is not None and self.slot_adapter[seq.lora_slot] != seq.request.lora:
                fail(f"running {seq.seq_id}'s LoRA adapter is in no slot")
        for seq in waiting:
            if seq.lora_slot != NO_SLOT:
                fail(f"waiting {seq.seq_id} holds LoRA slot {seq.lora_slot}")
