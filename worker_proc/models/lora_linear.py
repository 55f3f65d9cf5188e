"""LoRA's delta on a layer's projections: ``y = base(x) + (x @ A_s.T) @ B_s.T`` for each token, with
``s`` the slot of the token's request (-1: the base model, no delta).

A ``LoRAProjection`` holds every slot's A and B of the projections that share one input and write one
fused output (q/k/v into qkv; gate/up into gate_up; o and down alone): A as ``[slots, modules, rank,
in]``, so one product shrinks all of a group's modules, and each module's B as ``[slots, rank, out]``,
whose ``[slots * rank, out]`` view expands every slot at once. The scaling is folded into B at load;
an adapter of lower rank than the slots' is zero-padded, and a module it does not target is zeros.

A step's ``LoRABatch`` (built once, shared by every layer) names the path that computes the deltas:

- **native** (CPU, every step size): kernels/cpu_lora.c over the tokens grouped by slot, each token
  multiplied by its own slot's weights only, the batch read and written in place by index;
- **dense** (CPU without the native library, few tokens): ``s = x @ A_all.T`` over every slot, a mask
  keeping each token's own slot's columns, then ``s @ B_all``: two matmuls per projection however many
  adapters the step mixes, at ``slots``-fold the FLOPs of the token's own adapter;
- **segments** (CPU without the native library, many tokens): one shrink and one expand matmul per slot's
  segment at the adapter's own rank (a prompt chunk is a run of its batch already; otherwise the tokens sorted once);
- **bgmv** / **sgmv** (CUDA): the Triton kernels (kernels/lora.py), one slot index per token up to
  ``BGMV_MAX_TOKENS``, the sorted segments above.

Under tensor parallelism the slots hold this rank's part (worker_proc/lora_adapters.py cuts it):
column-parallel projections (q, k, v, gate, up) a full A and B for this rank's outputs, row-parallel ones (o,
down) A for this rank's inputs and a full B, their delta joining the partial output before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native

# CPU: kernels/cpu_lora.c at every step size where the native library is built, else the dense masked matmuls
# up to DENSE_MAX_TOKENS and the segments' matmul pairs above. Measured on the 0.5B shape's 24 layers, 8 slots of
# rank 16 on all seven projections, bfloat16, the weights cold, one thread of a shared Zen 5 (its CPU time,
# bench/log/2026-12-07.md): the native kernel 7.6 ms at 32 decode tokens (the one before it 14.3), 149 ms at 1024
# prompt tokens in runs of 128 a slot against the segments' 244; the dense path beats the segments up to ~256
# tokens and costs slots-fold FLOPs from there.
DENSE_MAX_TOKENS = 128
# Segments in batch order (no gather of rows by slot, no scatter back) when the runs average this many tokens.
MIN_MEAN_RUN = 16
# CUDA: up to this many tokens one slot index per token (BGMV), above it sorted segments (SGMV).
# Not measured on a GPU yet: vLLM's punica wrapper draws the same line between decode and prefill.
BGMV_MAX_TOKENS = 128
PATHS = ("native", "dense", "segments", "bgmv", "sgmv")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` (None: as many as --max-loras)."""

    max_loras: int = 4
    max_rank: int = 16
    max_cpu_loras: Optional[int] = None


def choose_path(device: torch.device, num_tokens: int) -> str:
    """The path a step of ``num_tokens`` tokens takes (PATHS)."""
    if device.type == "cuda":
        return "bgmv" if num_tokens <= BGMV_MAX_TOKENS else "sgmv"
    if cpu_native.supports_lora():
        return "native"
    return "dense" if num_tokens <= DENSE_MAX_TOKENS else "segments"


def path_description(device: torch.device) -> str:
    """The delta's kernels, for the worker's log."""
    if device.type == "cuda":
        return f"Triton BGMV up to {BGMV_MAX_TOKENS} tokens a step, SGMV segments above"
    if cpu_native.supports_lora():
        return "native grouped shrink and expand (cpu_lora.c) at every step size"
    return f"dense masked matmuls over every slot up to {DENSE_MAX_TOKENS} tokens a step, a matmul pair per segment above"


@dataclass(slots=True)
class LoRABatch:
    """One step's token -> slot map, and what its path needs of it, built once for every layer."""

    token_slots: torch.Tensor  # [T] long on the device: each token's slot, -1 for the base model
    max_loras: int
    max_rank: int
    dtype: torch.dtype
    path: str  # one of PATHS
    slot_ranks: tuple[int, ...]  # the rank of the adapter in each slot (0: empty)
    # the adapter tokens ordered by slot (segments: None where computed in batch order), and (slot, start, end)
    order: Optional[torch.Tensor] = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    seg_starts: Optional[torch.Tensor] = None  # native (int64), sgmv (int32): [S + 1] over ``order``
    seg_slots: Optional[torch.Tensor] = None  # [S]
    ranks: Optional[torch.Tensor] = None  # native: slot_ranks, int64
    _masks: dict = field(default_factory=dict)
    _rows: Optional[tuple[torch.Tensor, Optional["LoRABatch"]]] = None

    @classmethod
    def build(cls, token_slots_host: torch.Tensor, device: torch.device, max_loras: int, max_rank: int,
              dtype: torch.dtype, slot_ranks: tuple[int, ...], path: Optional[str] = None) -> "LoRABatch":
        """``token_slots_host``: [T] long on the host. ``path``: the step size's (choose_path) unless given."""
        path = path or choose_path(device, token_slots_host.shape[0])
        slots = token_slots_host.to(device, non_blocking=True) if device.type == "cuda" else token_slots_host
        batch = cls(slots, max_loras, max_rank, dtype, path, slot_ranks)
        if path == "segments":
            batch._runs_or_sorted(token_slots_host)
        elif path in ("native", "sgmv"):
            batch._sorted(token_slots_host, device, torch.int64 if path == "native" else torch.int32)
        return batch

    def _runs_or_sorted(self, host: torch.Tensor) -> None:
        """The batch's own runs where each slot is one run or the runs are long (prompt chunks: computed
        in place, no gather and scatter of rows), else the tokens sorted by slot."""
        values = host.tolist()
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                if values[start] >= 0:
                    runs.append((values[start], start, i))
                start = i
        if len({slot for slot, _, _ in runs}) == len(runs) or len(values) >= MIN_MEAN_RUN * len(runs):
            self.segments = runs
        else:
            self._sorted(host, host.device, torch.int64)

    def _sorted(self, host: torch.Tensor, device: torch.device, index_dtype: torch.dtype) -> None:
        order = torch.argsort(host, stable=True)
        order = order[int((host < 0).sum()):]  # the base model's tokens (-1) sort first: none of them
        counts = torch.bincount(host[order], minlength=self.max_loras).tolist()
        offset = 0
        for slot, count in enumerate(counts):
            if count:
                self.segments.append((slot, offset, offset + count))
                offset += count
        starts = torch.tensor([first for _, first, _ in self.segments] + [offset], dtype=index_dtype)
        slots = torch.tensor([slot for slot, _, _ in self.segments], dtype=index_dtype)
        if device.type == "cuda":
            self.order, self.seg_starts, self.seg_slots = (t.to(device, non_blocking=True)
                                                           for t in (order, starts, slots))
        else:
            self.order, self.seg_starts, self.seg_slots = order, starts, slots
            self.ranks = torch.tensor(self.slot_ranks, dtype=torch.int64)

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
                sub = LoRABatch(slots, self.max_loras, self.max_rank, self.dtype, "bgmv", self.slot_ranks)
            else:
                sub = (LoRABatch.build(slots, slots.device, self.max_loras, self.max_rank, self.dtype,
                                       self.slot_ranks, _rows_path(self.path, slots.shape[0]))
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
        self._kernel: Optional[cpu_native.LoRAGroupKernel] = None  # the native path's call, built on first use

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
        self._kernel = None

    def clear(self, slot: int) -> None:
        for j, targeted in enumerate(self.slot_targets[slot]):
            if targeted:
                self.num_targeting[j] -= 1
                self.a[slot, j].zero_()
                self.b[j][slot].zero_()
        self.slot_targets[slot] = (False,) * len(self.names)
        self._kernel = None

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, lora: Optional[LoRABatch],
                  ops: Optional[ModuleType] = None) -> torch.Tensor:
        """``out`` (x's base product, [T, fused out]) plus each token's adapter delta, in place."""
        if lora is None or not any(self.num_targeting):
            return out
        if lora.path in ("bgmv", "sgmv"):
            self._triton(x, out, lora, ops)
        elif lora.path == "native":
            self._native(x, out, lora)
        elif lora.path == "dense":
            self._dense(x, out, lora)
        else:
            self._segments(x, out, lora)
        return out

    def _native(self, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch) -> None:
        if self._kernel is None:  # until a slot's adapter changes which modules are targeted
            slots, modules = self.a.shape[0], self.a.shape[1]
            self._kernel = cpu_native.LoRAGroupKernel(
                self.a.view(slots, modules * self.max_rank, self.in_features), self.b,
                [start for start, _ in self.columns], [bool(n) for n in self.num_targeting])
        self._kernel(x, out, lora.order, lora.seg_starts, lora.seg_slots, lora.ranks)

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
        if lora.path == "bgmv":  # one slot per token, straight into out
            s = torch.zeros(x.shape[0], modules * rank, dtype=torch.float32, device=x.device)
            ops.lora_shrink(x, a, lora.token_slots, s)
            for j, (start, end) in enumerate(self.columns):
                if self.num_targeting[j]:
                    ops.lora_expand(s[:, j * rank:(j + 1) * rank], self.b[j], lora.token_slots,
                                    out[:, start:end])
            return
        xs = x.index_select(0, lora.order)
        longest = max(last - first for _, first, last in lora.segments)
        s = torch.zeros(xs.shape[0], modules * rank, dtype=torch.float32, device=x.device)
        ops.lora_shrink_segments(xs, a, lora.seg_starts, lora.seg_slots, s, longest)
        delta = out.new_zeros(xs.shape[0], out.shape[1])
        for j, (start, end) in enumerate(self.columns):
            if self.num_targeting[j]:
                ops.lora_expand_segments(s[:, j * rank:(j + 1) * rank], self.b[j], lora.seg_starts,
                                         lora.seg_slots, delta[:, start:end], longest)
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


def _rows_path(path: str, num_rows: int) -> str:
    """The last layer's rows take the step's CPU path, or a smaller step's where theirs is one."""
    return path if path != "segments" else choose_path(torch.device("cpu"), num_rows)


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
