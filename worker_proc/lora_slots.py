"""The worker's LoRA adapter slots (``--max-loras``): which adapter each holds, and a step's changes.

Every slot's weights are allocated at start, for every adaptable projection of every layer
(models/lora_linear.py's ``LoRAProjection``; a mixture of experts' routed experts: models/lora_experts.py);
a load copies an adapter's tensors from the host cache (worker_proc/lora_adapters.py) into its slot in
place, on the stream that runs the model, before the step's forward. The scheduler decides everything
(protocol/messages.py ``LoRAStep``): the worker applies a step's ``forget``, then its ``loads``, then
gives each new request its slot, and reads ``prefetch`` into the host cache in the background. It never
reassigns a slot a held request uses; the check here only stops a broken scheduler from computing a
request with another adapter.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedserve.protocol.lora_adapter import LoRAAdapterError
from pagedserve.protocol.messages import LoRAAdapter, LoRAStep, SchedulerOutput
from pagedserve.protocol.step_state import HeldRequest, StepContractError
from pagedserve.worker_proc.lora_adapters import AdapterReader, HostAdapter, HostAdapterCache
from pagedserve.worker_proc.models.lora_experts import ExpertLoRA
from pagedserve.worker_proc.models.lora_linear import LayerLoRA, LoRABatch

log = logging.getLogger("pagedserve.worker")


class LoRASlots:
    def __init__(self, layers: list[LayerLoRA], max_loras: int, max_rank: int, reader: AdapterReader,
                 max_cpu_loras: Optional[int], device: torch.device, dtype: torch.dtype):
        self.layers, self.max_loras, self.max_rank = layers, max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.adapters: list[Optional[LoRAAdapter]] = [None] * max_loras  # what each slot holds
        self.ranks = [0] * max_loras
        self.host = HostAdapterCache(reader, max(max_cpu_loras or max_loras, max_loras))
        self._pending: list[LoRAStep] = []  # received, applied with their step's SchedulerOutput (one)
        self._modules = [layer.modules() for layer in layers]

    @property
    def slot_bytes(self) -> int:
        """Device bytes of every slot's weights."""
        return sum(t.numel() * t.element_size() for layer in self.layers for p in layer.projections
                   for t in (p.weights() if isinstance(p, ExpertLoRA) else (p.a, *p.b)))

    # ------------------------------------------------------------------ a step's changes

    def receive(self, msg: LoRAStep) -> None:
        """A LoRAStep, just before its SchedulerOutput: reads start now, in the background (its loads'
        too, so their reads overlap what is left of the step before); the rest waits for ``apply``,
        which also judges the order they came in."""
        self._pending.append(msg)
        for name in msg.forget:
            self.host.forget(name)
        for adapter in msg.prefetch:
            self.host.prefetch(adapter)
        for load in msg.loads:
            self.host.prefetch(load.adapter)

    def apply(self, out: SchedulerOutput, held: dict[str, HeldRequest], new: list[HeldRequest]) -> None:
        """The pending LoRAStep of ``out``'s step, after ``out`` is applied to ``held`` (finished
        requests gone, ``new`` its new requests)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if len(pending) > 1 or pending[0].step != out.step:
            raise StepContractError(f"LoRASteps {[p.step for p in pending]} arrived before the SchedulerOutput "
                                    f"of step {out.step} (one, of the same step, was expected)")
        msg = pending[0]
        in_use = {state.lora_slot for state in held.values()}
        for slot, adapter in enumerate(self.adapters):
            if adapter is not None and adapter.name in msg.forget:
                self._check_free(slot, in_use, f"forget {adapter.name!r}")
                self._clear(slot)
        for load in msg.loads:
            if not 0 <= load.slot < self.max_loras:
                raise StepContractError(f"LoRAStep {msg.step}: slot {load.slot} is not one of the "
                                        f"{self.max_loras} slots (--max-loras)")
            if self.adapters[load.slot] != load.adapter:
                self._check_free(load.slot, in_use, f"load {load.adapter.name!r}")
                self._load(load.slot, self.host.get(load.adapter))
        by_id = {state.req_id: state for state in new}
        for req_id, slot in msg.request_slots.items():
            state = by_id.get(req_id)
            if state is None:
                raise StepContractError(f"LoRAStep {msg.step}: request {req_id!r} is not a new request of the step")
            if not 0 <= slot < self.max_loras or self.adapters[slot] is None:
                raise StepContractError(f"LoRAStep {msg.step}: request {req_id!r} is given slot {slot}, "
                                        "which holds no adapter")
            state.lora_slot = slot

    def discard_pending(self) -> None:
        """A WorkerInit starts over: LoRASteps received for steps that will never come are dropped (the
        slots keep their adapters; the scheduler's first LoRAStep loads every occupied slot again)."""
        self._pending.clear()

    def _check_free(self, slot: int, in_use: set[int], what: str) -> None:
        # The scheduler never reassigns a slot a held request uses (protocol/messages.py LoRAStep).
        assert slot not in in_use, f"{what}: slot {slot} holds {self.adapters[slot]} for a running request"

    def _load(self, slot: int, adapter: HostAdapter) -> None:
        for layer, modules in adapter.layers.items():
            missing = set(modules) - set(self._modules[layer])
            if missing:
                raise LoRAAdapterError(f"LoRA adapter {adapter.adapter.name!r}: layer {layer} has no "
                                       f"{', '.join(sorted(missing))} here (a mixture-of-experts layer's MLP)")
        self._clear(slot)
        for layer, modules in enumerate(self._modules):
            tensors = adapter.layers.get(layer, {})
            for projection in self.layers[layer].projections:
                wanted = {name: tensors[name] for name in projection.names if name in tensors}
                if wanted:
                    projection.load(slot, wanted)
        self.adapters[slot], self.ranks[slot] = adapter.adapter, adapter.spec.rank
        log.info("LoRA slot %d: %s (rank %d, %s)", slot, adapter.adapter.name, adapter.spec.rank,
                 ", ".join(adapter.spec.target_modules))

    def _clear(self, slot: int) -> None:
        for layer in self.layers:
            for projection in layer.projections:
                projection.clear(slot)
        self.adapters[slot], self.ranks[slot] = None, 0

    # ------------------------------------------------------------------ a step's tokens

    def batch(self, scheduled: list[HeldRequest], num_scheduled: list[int]) -> Optional[LoRABatch]:
        """The step's token -> slot map, or None when no token has an adapter (no LoRA work at all)."""
        slots = [state.lora_slot for state in scheduled]
        if max(slots, default=-1) < 0:
            return None
        token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(num_scheduled))
        return LoRABatch.build(token_slots, self.device, self.max_loras, self.max_rank, self.dtype, tuple(self.ranks))

    def close(self) -> None:
        self.host.close()
