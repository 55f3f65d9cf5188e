"""LoRA's delta on a layer's projections: ``y = base(x) + (x @ A_s.T) @ B_s.T`` for each token, with
``s`` the slot of the token's request (-1: the base model, no delta).

A ``LoRAProjection`` holds every slot's A and B of the projections that share one input and write one
fused output (q/k/v into qkv; gate/up into gate_up; o and down alone): A as ``[slots, modules, rank,
in]``, so one matmul shrinks all of a group's modules, and each module's B as ``[slots, rank, out]``,
whose ``[slots * rank, out]`` view expands every slot at once. The scaling is folded into B at load;
an adapter of lower rank than the slots' is zero-padded, and a module it does not target is zeros.

A step's ``LoRABatch`` (built once, shared by every layer) says which path computes the deltas:

- **dense** (few tokens: decodes): ``s = x @ A_all.T`` over every slot, a mask keeping each token's
  own slot's columns, then ``s @ B_all.T``: two matmuls per projection however many adapters the step
  mixes, at ``slots``-fold the FLOPs of the token's own adapter, which is nothing beside the base
  weight's at a few rows;
- **segments** (many tokens: prefill): the adapter tokens grouped by slot (a step's prompt chunks are
  runs already; otherwise sorted once), one shrink and one expand per segment at the adapter's own
  rank, no FLOPs on other slots;
- on CUDA, the Triton kernels (kernels/lora.py): BGMV (one slot per token) up to ``BGMV_MAX_TOKENS``,
  SGMV over the sorted segments above.

Under tensor parallelism the slots hold this rank's part (worker_proc/lora_adapters.py slices it):
column-parallel projections a full A and B's rows, row-parallel ones A's columns and a full B, and
their delta joins the partial output before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

# Up to this many tokens a CPU step takes the dense path, above it the segments. Measured on the 0.5B
# shape (8 slots of rank 16, all seven projections, 2 threads of a Zen 5; tests/unit/test_lora_worker.py's
# bench_lora_paths): see bench/log and the worker's log line.
DENSE_MAX_TOKENS = 16
# Segments in batch order (no gather of rows by slot, no scatter back) when the runs average this many tokens.
MIN_MEAN_RUN = 16
# CUDA: up to this many tokens one slot index per token (BGMV), above it sorted segments (SGMV).
# Not measured on a GPU yet: vLLM's punica wrapper draws the same line between decode and prefill.
BGMV_MAX_TOKENS = 128


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` (None: as many as --max-loras)."""

    max_loras: int = 4
    max_rank: int = 16
    max_cpu_loras: Optional[int] = None


def path_description(device: torch.device) -> str:
    """The delta's kernels, for the worker's log."""
    if device.type == "cuda":
        return f"Triton BGMV up to {BGMV_MAX_TOKENS} tokens a step, SGMV segments above"
    return (f"dense masked matmuls over every slot up to {DENSE_MAX_TOKENS} tokens a step, "
            f"one matmul pair per adapter segment above")


@dataclass(slots=True)
class LoRABatch:
    """One step's token -> slot map, and what each path needs of it, built once for every layer."""

    token_slots: torch.Tensor  # [T] long on the device: each token's slot, -1 for the base model
    max_loras: int
    max_rank: int
    dtype: torch.dtype
    dense: bool  # the dense path (CPU) or BGMV (CUDA); else segments
    slot_ranks: tuple[int, ...]  # the rank of the adapter in each slot (0: empty)
    # segments: tokens ordered by slot (None: already grouped in batch order) and (slot, start, end)
    order: Optional[torch.Tensor] = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    seg_starts: Optional[torch.Tensor] = None  # CUDA SGMV: [S + 1] int32 over the ordered tokens
    seg_slots: Optional[torch.Tensor] = None  # [S] int32
    _masks: dict = field(default_factory=dict)
    _rows: Optional[tuple[torch.Tensor, "LoRABatch"]] = None

    @classmethod
    def build(cls, token_slots_host: torch.Tensor, device: torch.device, max_loras: int, max_rank: int,
              dtype: torch.dtype, slot_ranks: tuple[int, ...]) -> "LoRABatch":
        """``token_slots_host``: [T] long on the host."""
        num_tokens = token_slots_host.shape[0]
        cuda = device.type == "cuda"
        dense = num_tokens <= (BGMV_MAX_TOKENS if cuda else DENSE_MAX_TOKENS)
        slots = token_slots_host.to(device, non_blocking=True) if cuda else token_slots_host
        batch = cls(slots, max_loras, max_rank, dtype, dense, slot_ranks)
        if not dense:
            batch._group(token_slots_host, device)
        return batch

    def _group(self, host: torch.Tensor, device: torch.device) -> None:
        """The segments of adapter tokens by slot: the batch's own runs where each slot is one run
        (prompt chunks), else the adapter tokens sorted by slot."""
        values = host.tolist()
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                if values[start] >= 0:
                    runs.append((values[start], start, i))
                start = i
        # Runs of a prompt chunk each are long: computed in place, no gather and scatter of the rows
        if device.type != "cuda" and (len({slot for slot, _, _ in runs}) == len(runs)
                                      or len(values) >= MIN_MEAN_RUN * len(runs)):
            self.segments = runs
            return
        order = torch.argsort(host, stable=True)
        first = int((host < 0).sum())
        order = order[first:]
        counts = torch.bincount(host[order], minlength=self.max_loras).tolist()
        offset = 0
        for slot, count in enumerate(counts):
            if count:
                self.segments.append((slot, offset, offset + count))
                offset += count
        self.order = order.to(device)
        if device.type == "cuda":
            starts = [s for _, s, _ in self.segments] + [offset]
            self.seg_starts = torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)
            self.seg_slots = torch.tensor([s for s, _, _ in self.segments], dtype=torch.int32).to(
                device, non_blocking=True)

    def mask(self, width: int) -> torch.Tensor:
        """[T, slots * width] of 1 where a column belongs to the token's slot (dense path)."""
        mask = self._masks.get(width)
        if mask is None:
            column_slot = torch.arange(self.max_loras, device=self.token_slots.device).repeat_interleave(width)
            mask = self._masks[width] = (column_slot[None, :] == self.token_slots[:, None]).to(self.dtype)
        return mask

    def rows(self, rows: torch.Tensor) -> Optional["LoRABatch"]:
        """The batch of only ``rows`` (the last layer's output rows), or None if none has an adapter."""
        if self._rows is None or self._rows[0] is not rows:
            slots = self.token_slots[rows]
            if slots.device.type == "cuda":  # BGMV over the rows: no host round trip
                sub = LoRABatch(slots, self.max_loras, self.max_rank, self.dtype, True, self.slot_ranks)
            else:
                sub = (LoRABatch.build(slots, slots.device, self.max_loras, self.max_rank, self.dtype, self.slot_ranks)
                       if bool((slots >= 0).any()) else None)
            self._rows = (rows, sub)
        return self._rows[1]


class LoRAProjection:
    """Every slot's adapter weights of the modules that share an input: (name, first output column,
    output columns) each, side by side in the layer's fused output."""

    def __init__(self, modules: list[tuple[str, int, int]], in_features: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.names = [name for name, _, _ in modules]
        self.columns = [(start, start + size) for _, start, size in modules]
        self.in_features, self.max_rank = in_features, max_rank
        self.a = torch.zeros(max_loras, len(modules), max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for _, _, size in modules]
        # which modules each slot's adapter targets; how many slots target each module (0: skipped)
        self.slot_targets: list[tuple[bool, ...]] = [(False,) * len(modules)] * max_loras
        self.num_targeting = [0] * len(modules)

    def out_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of module ``name``'s product on this rank."""
        start, end = self.columns[self.names.index(name)]
        return end - start, self.in_features

    def load(self, slot: int, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` takes an adapter's (A [r, in], B [out, r] scaled) by module name, in place
        (the other modules: zeros)."""
        self.clear(slot)
        targets = []
        for j, name in enumerate(self.names):
            pair = tensors.get(name)
            targets.append(pair is not None)
            if pair is not None:
                a, b = pair
                rank = a.shape[0]
                self.a[slot, j, :rank].copy_(a, non_blocking=True)
                self.b[j][slot, :rank].copy_(b.t(), non_blocking=True)
                self.num_targeting[j] += 1
        self.slot_targets[slot] = tuple(targets)

    def clear(self, slot: int) -> None:
        for j, targeted in enumerate(self.slot_targets[slot]):
            if targeted:
                self.num_targeting[j] -= 1
                self.a[slot, j].zero_()
                self.b[j][slot].zero_()
        self.slot_targets[slot] = (False,) * len(self.names)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, lora: Optional[LoRABatch],
                  ops: Optional[ModuleType] = None) -> torch.Tensor:
        """``out`` (x's base product, [T, fused out]) plus each token's adapter delta, in place."""
        if lora is None or not any(self.num_targeting):
            return out
        if x.device.type == "cuda" and ops is not None and hasattr(ops, "lora_shrink"):
            self._triton(x, out, lora, ops)
        elif lora.dense:
            self._dense(x, out, lora)
        else:
            self._segments(x, out, lora)
        return out

    def _dense(self, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch) -> None:
        slots, modules, rank = self.a.shape[0], self.a.shape[1], self.max_rank
        tokens = x.shape[0]
        s = F.linear(x, self.a.view(slots * modules * rank, self.in_features))
        s.mul_(lora.mask(modules * rank))
        s = s.view(tokens, slots, modules, rank)
        for j, (start, end) in enumerate(self.columns):
            if self.num_targeting[j]:
                sj = s[:, :, j].reshape(tokens, slots * rank)
                out[:, start:end] += sj @ self.b[j].view(slots * rank, end - start)

    def _segments(self, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch) -> None:
        modules, rank = self.a.shape[1], self.max_rank
        xs = x if lora.order is None else x.index_select(0, lora.order)
        target = out if lora.order is None else out.new_zeros(xs.shape[0], out.shape[1])
        for slot, first, last in lora.segments:
            targets, r = self.slot_targets[slot], lora.slot_ranks[slot]
            if not any(targets):
                continue
            s = F.linear(xs[first:last], self.a[slot].view(modules * rank, self.in_features))
            for j, (start, end) in enumerate(self.columns):
                if targets[j]:
                    target[first:last, start:end] += s[:, j * rank:j * rank + r] @ self.b[j][slot, :r]
        if lora.order is not None:
            out.index_add_(0, lora.order, target)

    def _triton(self, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch, ops: ModuleType) -> None:
        slots, modules, rank = self.a.shape[0], self.a.shape[1], self.max_rank
        a = self.a.view(slots, modules * rank, self.in_features)
        if lora.dense:  # BGMV: one slot per token, straight into out
            s = torch.zeros(x.shape[0], modules * rank, dtype=torch.float32, device=x.device)
            ops.lora_shrink(x, a, lora.token_slots, s)
            for j, (start, end) in enumerate(self.columns):
                if self.num_targeting[j]:
                    ops.lora_expand(s[:, j * rank:(j + 1) * rank], self.b[j], lora.token_slots,
                                    out[:, start:end])
            return
        xs = x.index_select(0, lora.order)
        s = torch.zeros(xs.shape[0], modules * rank, dtype=torch.float32, device=x.device)
        ops.lora_shrink_segments(xs, a, lora.seg_starts, lora.seg_slots, s)
        delta = out.new_zeros(xs.shape[0], out.shape[1])
        for j, (start, end) in enumerate(self.columns):
            if self.num_targeting[j]:
                ops.lora_expand_segments(s[:, j * rank:(j + 1) * rank], self.b[j], lora.seg_starts,
                                         lora.seg_slots, delta[:, start:end])
        out.index_add_(0, lora.order, delta)


@dataclass(slots=True)
class LayerLoRA:
    """One decoder layer's adapter slots: qkv, o, and (a dense MLP's) gate_up and down."""

    qkv: LoRAProjection
    o: LoRAProjection
    gate_up: Optional[LoRAProjection]
    down: Optional[LoRAProjection]

    @property
    def projections(self) -> list[LoRAProjection]:
        return [p for p in (self.qkv, self.o, self.gate_up, self.down) if p is not None]

    def modules(self) -> dict[str, LoRAProjection]:
        """The projection that holds each module name of this layer."""
        return {name: p for p in self.projections for name in p.names}


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def layer_lora(qkv_names: tuple[str, ...], gate_up_names: Optional[tuple[str, ...]], o_name: str,
               down_name: Optional[str], hidden: int, q_size: int, kv_size: int, intermediate: int,
               config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> LayerLoRA:
    """The slots of a layer whose checkpoint names its projections so (models/family.py's LayerNames):
    split q/k/v (gate/up) or fused, with this rank's sizes."""
    def group(names: tuple[str, ...], sizes: tuple[int, ...], in_features: int) -> LoRAProjection:
        if len(names) == 1:
            sizes = (sum(sizes),)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return LoRAProjection([(_short(n), s, z) for n, s, z in zip(names, starts, sizes)], in_features,
                              config.max_loras, config.max_rank, dtype, device)

    qkv = group(qkv_names, (q_size, kv_size, kv_size), hidden)
    o = group((o_name,), (hidden,), q_size)
    gate_up = group(gate_up_names, (intermediate, intermediate), hidden) if gate_up_names else None
    down = group((down_name,), (hidden,), intermediate) if down_name else None
    return LayerLoRA(qkv, o, gate_up, down)
