"""LoRA on a mixture of experts' routed experts: each token's adapter delta inside the experts it is routed to.

PEFT adapts transformers 5's fused expert parameters (protocol/lora_adapter.py): per expert e an A
``[r, in]`` and a B ``[out, r]`` on ``gate_up`` and on ``down``. An ``ExpertLoRA`` holds every slot's
of one sparse layer, as ``[experts, slots, rank, in]`` and ``[experts, slots, rank, out]`` (B
transposed, as models/lora_linear.py keeps it), this rank's part (worker_proc/lora_adapters.py cuts
it: gate_up's output rows, down's input columns, as the base experts are split).

The base experts run as before (models/moe.py); for each active expert, each of its rows (token, expert
pairs) adds ``(x @ A.T) @ B`` of its token's slot to gate_up's product before the activation and to down's
product before the routing weight (``ExpertDeltas``), as vLLM's fused-MoE LoRA adds its deltas into the
same two intermediate products. Tokens of the base model (slot -1) and slots whose
adapter leaves the experts alone take none. Under tensor parallelism each rank's down delta is its
part of the sum, joining the layer's one all-reduce.

A shared expert (Qwen2-MoE) is three plain linears: ``LoRAProjection``s like a dense MLP's
(``MoeLayerLoRA.gate_up`` / ``down``, modules ``shared_expert.*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

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
        shape = (num_experts, config.max_loras, config.max_rank)
        # per module, expert-major (one expert's slots are one [slots * rank, features] matrix):
        # A [experts, slots, rank, in], B [experts, slots, rank, out]
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
                self.a[j][:, slot, :rank].copy_(a, non_blocking=True)
                self.b[j][:, slot, :rank].copy_(b.transpose(1, 2), non_blocking=True)
        self.slot_targets[slot] = (targets[0], targets[1])

    def clear(self, slot: int) -> None:
        for j, targeted in enumerate(self.slot_targets[slot]):
            if targeted:
                self.a[j][:, slot].zero_()
                self.b[j][:, slot].zero_()
        self.slot_targets[slot] = (False, False)

    def deltas(self, lora: Optional[LoRABatch]) -> Optional["ExpertDeltas"]:
        """The step's deltas on these experts, or None when no slot's adapter adapts them."""
        if lora is None or not any(any(t) for t in self.slot_targets):
            return None
        return ExpertDeltas(self, lora)


class ExpertDeltas:
    """One forward's adapter deltas on a layer's experts: the interface models/moe.py's grouped experts
    and kernels/moe_reference.py's loop call per active expert (``mask`` once, then ``add`` twice).

    Per expert and module, two matmuls whatever the slots its rows mix: ``s = x @ A_e.T`` over every
    slot's A (``[slots * rank, in]``), masked to the columns of each row's own slot, then ``s @ B_e`` (the
    dense path of models/lora_linear.py, per expert); an expert whose rows are all one slot's (a single
    stream, a prompt chunk) reads only that slot's A and B at its own rank. The mask costs slots-fold the
    rank's FLOPs, small beside the expert's own product. A loop over each expert's slot groups instead
    cost a few small ops per group, most of a decode step at 32 sequences over 4 adapters (3.5x the base
    step's time, against 1.3-1.6x masked, on a shared Zen 5). bench/scripts/moe_cpu_bench.py
    ``--lora-slots`` times the experts with and without adapters."""

    def __init__(self, weights: ExpertLoRA, lora: LoRABatch):
        self.weights, self.token_slots, self.dtype = weights, lora.token_slots, weights.a[0].dtype
        self.ranks = lora.slot_ranks
        _, slots, rank, _ = weights.a[0].shape
        self.column_slot = torch.arange(slots, device=lora.token_slots.device).repeat_interleave(rank)
        self.targeted = [any(t[j] for t in weights.slot_targets) for j in (GATE_UP, DOWN)]

    def mask(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """[rows, slots * rank]: 1 where a column is the row's token's slot's; None when no row's token
        has an adapter (``tokens``: each of an expert's rows' token)."""
        slots = self.token_slots[tokens]
        if not bool((slots >= 0).any()):
            return None
        return (slots[:, None] == self.column_slot[None, :]).to(self.dtype)

    def masks(self, tokens: torch.Tensor, counts: list[int]) -> list[Union[None, int, torch.Tensor]]:
        """``mask`` of each expert's run of rows, made at once for rows sorted by expert (``tokens``: each
        row's token; ``counts``: each expert's rows): a handful of ops a layer, not a handful an expert.
        An expert whose rows are all one slot's gets that slot (``add`` reads only its weights)."""
        slots = self.token_slots[tokens]
        experts = torch.repeat_interleave(torch.arange(len(counts), device=slots.device),
                                          torch.tensor(counts, device=slots.device))
        per_expert = torch.zeros(3, len(counts), dtype=torch.int64, device=slots.device)
        per_expert[0].index_add_(0, experts, (slots >= 0).long())  # rows with an adapter
        per_expert[1].scatter_reduce_(0, experts, slots, "amin", include_self=False)
        per_expert[2].scatter_reduce_(0, experts, slots, "amax", include_self=False)
        every = None
        masks: list[Union[None, int, torch.Tensor]] = []
        start = 0
        for count, (adapted, lowest, highest) in zip(counts, zip(*per_expert.tolist())):
            if not adapted:
                masks.append(None)
            elif adapted == count and lowest == highest:
                masks.append(lowest)
            else:
                if every is None:
                    every = (slots[:, None] == self.column_slot[None, :]).to(self.dtype)
                masks.append(every[start: start + count])
            start += count
        return masks

    def add(self, module: int, expert: int, x: torch.Tensor, out: torch.Tensor,
            mask: Union[int, torch.Tensor]) -> None:
        """``out`` (the expert's ``module`` product of ``x``, GATE_UP or DOWN) plus each row's delta, in
        place; ``mask``: ``mask``'s, or the one slot of every row."""
        if not self.targeted[module]:
            return
        a, b = self.weights.a[module][expert], self.weights.b[module][expert]  # [slots, rank, in | out]
        if isinstance(mask, int):
            if not self.weights.slot_targets[mask][module]:
                return
            rank = self.ranks[mask]
            out.addmm_(x @ a[mask, :rank].t(), b[mask, :rank])
            return
        shrunk = (x @ a.view(-1, a.shape[-1]).t()).mul_(mask)
        out.addmm_(shrunk, b.view(-1, b.shape[-1]))


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
