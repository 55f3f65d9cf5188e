"""LoRA on a mixture of experts' routed experts: each token's adapter delta inside the experts it is routed to.

PEFT adapts transformers 5's fused expert parameters (protocol/lora_adapter.py): per expert e an A
``[r, in]`` and a B ``[out, r]`` on ``gate_up`` and on ``down``. An ``ExpertLoRA`` holds every slot's
of one sparse layer, as ``[slots, experts, rank, in]`` and ``[slots, experts, rank, out]`` (B
transposed, as models/lora_linear.py keeps it), this rank's part (worker_proc/lora_adapters.py cuts
it: gate_up's output rows, down's input columns, as the base experts are split).

The base experts run as before (models/moe.py); for each active expert, its rows (token, expert pairs)
are grouped by their tokens' slots and each group adds ``(x @ A.T) @ B`` to gate_up's product before the
activation and to down's product before the routing weight: one shrink and one expand matmul per
(expert, slot) pair the step routes to, at the adapter's own rank, as vLLM's fused-MoE LoRA adds its
deltas into the same two intermediate products. Tokens of the base model (slot -1) and slots whose
adapter leaves the experts alone take none. Under tensor parallelism each rank's down delta is its
part of the sum, joining the layer's one all-reduce.

A shared expert (Qwen2-MoE) is three plain linears: ``LoRAProjection``s like a dense MLP's
(``MoeLayerLoRA.gate_up`` / ``down``, modules ``shared_expert.*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.protocol.lora_adapter import EXPERT_MODULES
from pagedserve.worker_proc.models.lora_linear import LayerLoRA, LoRABatch, LoRAConfig, LoRAProjection

GATE_UP, DOWN = 0, 1  # ExpertLoRA's modules, in EXPERT_MODULES' order


class ExpertLoRA:
    """Every slot's adapter weights on one sparse layer's routed experts (``names``: EXPERT_MODULES)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device):
        """``intermediate``: this rank's part of each expert's intermediate features."""
        self.names = EXPERT_MODULES
        shape = (config.max_loras, num_experts, config.max_rank)
        # per module: A [slots, experts, rank, in], B [slots, experts, rank, out]
        self.a = [torch.zeros(*shape, hidden, dtype=dtype, device=device),
                  torch.zeros(*shape, intermediate, dtype=dtype, device=device)]
        self.b = [torch.zeros(*shape, 2 * intermediate, dtype=dtype, device=device),
                  torch.zeros(*shape, hidden, dtype=dtype, device=device)]
        self.slot_targets: list[tuple[bool, bool]] = [(False, False)] * config.max_loras

    def weights(self) -> list[torch.Tensor]:
        return [*self.a, *self.b]

    def load(self, slot: int, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` takes an adapter's (A [E, r, in], B [E, out, r] scaled) by module name."""
        self.clear(slot)
        targets = []
        for j, name in enumerate(self.names):
            pair = tensors.get(name)
            targets.append(pair is not None)
            if pair is not None:
                a, b = pair
                rank = a.shape[1]
                self.a[j][slot, :, :rank].copy_(a, non_blocking=True)
                self.b[j][slot, :, :rank].copy_(b.transpose(1, 2), non_blocking=True)
        self.slot_targets[slot] = (targets[0], targets[1])

    def clear(self, slot: int) -> None:
        for j, targeted in enumerate(self.slot_targets[slot]):
            if targeted:
                self.a[j][slot].zero_()
                self.b[j][slot].zero_()
        self.slot_targets[slot] = (False, False)

    def deltas(self, lora: Optional[LoRABatch]) -> Optional["ExpertDeltas"]:
        """The step's deltas on these experts, or None when no slot's adapter adapts them."""
        if lora is None or not any(any(t) for t in self.slot_targets):
            return None
        return ExpertDeltas(self, lora)


class ExpertDeltas:
    """One forward's adapter deltas on a layer's experts: the interface models/moe.py's grouped experts
    and kernels/moe_reference.py's loop call per active expert (``groups`` once, then ``add`` twice)."""

    def __init__(self, weights: ExpertLoRA, lora: LoRABatch):
        self.weights, self.token_slots, self.ranks = weights, lora.token_slots, lora.slot_ranks

    def groups(self, tokens: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
        """An expert's rows (``tokens``: each row's token) by the slot of an adapter on the experts:
        (slot, its rows, or None for all of them)."""
        slots = self.token_slots[tokens]
        present = [s for s in torch.unique(slots).tolist() if s >= 0 and any(self.weights.slot_targets[s])]
        if len(present) == 1 and bool((slots == present[0]).all()):
            return [(present[0], None)]
        return [(s, (slots == s).nonzero().squeeze(1)) for s in present]

    def add(self, module: int, expert: int, x: torch.Tensor, out: torch.Tensor,
            groups: list[tuple[int, Optional[torch.Tensor]]]) -> None:
        """``out`` (the expert's ``module`` product of ``x``, GATE_UP or DOWN) plus each group's delta, in place."""
        a, b = self.weights.a[module], self.weights.b[module]
        for slot, rows in groups:
            if not self.weights.slot_targets[slot][module]:
                continue
            r = self.ranks[slot]
            if rows is None:
                out += (x @ a[slot, expert, :r].t()) @ b[slot, expert, :r]
            else:
                out.index_add_(0, rows, (x[rows] @ a[slot, expert, :r].t()) @ b[slot, expert, :r])


@dataclass(slots=True)
class MoeLayerLoRA(LayerLoRA):
    """A sparse layer's adapter slots: attention's, the shared expert's (``gate_up`` / ``down``, if any)
    and the routed experts'."""

    experts: Optional[ExpertLoRA] = None

    @property
    def projections(self) -> list:
        return [p for p in (self.qkv, self.o, self.gate_up, self.down, self.experts) if p is not None]


def shared_expert_lora(hidden: int, intermediate: int, config: LoRAConfig, dtype: torch.dtype,
                       device: torch.device) -> tuple[LoRAProjection, LoRAProjection]:
    """A shared expert's gate_up and down slots (``intermediate``: this rank's part)."""
    gate_up = LoRAProjection([("shared_expert.gate_proj", 0, intermediate),
                              ("shared_expert.up_proj", intermediate, intermediate)],
                             hidden, config.max_loras, config.max_rank, dtype, device)
    down = LoRAProjection([("shared_expert.down_proj", 0, hidden)], intermediate, config.max_loras,
                          config.max_rank, dtype, device)
    return gate_up, down


def expert_rows(module: str, part: tuple[int, int], intermediate: int, interleaved: bool) -> torch.Tensor:
    """This rank's rows of a PEFT expert B (gate_up: its [gate; up] outputs, ``interleaved`` where the
    checkpoint alternates gate and up columns, gpt-oss) or columns of A (down's inputs), in the order
    the base experts' slices keep them (models/moe.py)."""
    a, b = part
    if module == EXPERT_MODULES[DOWN]:
        return torch.arange(a, b)
    if interleaved:
        return torch.cat([torch.arange(2 * a, 2 * b, 2), torch.arange(2 * a + 1, 2 * b, 2)])
    return torch.cat([torch.arange(a, b), torch.arange(intermediate + a, intermediate + b)])
