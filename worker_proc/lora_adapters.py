"""The worker's host cache of LoRA adapters: read from disk, checked, sliced for this rank, least
recently used dropped first (``--max-cpu-loras``).

An adapter is read as the frontend judged it: ``read_adapter`` again (against this model's projection
shapes and layer count), then its files' bytes, whose sha256 must be the digest the LoRAAdapter
carries: files changed since the frontend accepted them are refused, not served as another adapter.
The tensors are loaded from those same bytes (safetensors, no pickle), B is scaled (``lora_alpha / r``,
rsLoRA's ``/ sqrt(r)``, each module's own where a rank / alpha pattern sets it), both are cast to the
model's dtype and cut to this tensor-parallel rank's part, so loading a slot later is a plain copy. The routed experts' A ``[r * E, in]`` and B ``[out, r * E]``
(PEFT's layout, protocol/lora_adapter.py) become ``[E, r, in]`` and ``[E, out, r]``. ``prefetch`` reads
on a background thread; ``get`` of an adapter not yet read reads it at once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from pagedserve.protocol.lora_adapter import (CONFIG_FILE, EXPERT_MODULES, WEIGHTS_FILE, AdapterSpec,
                                              LoRAAdapterError, read_adapter)
from pagedserve.protocol.messages import LoRAAdapter

# module -> how this rank cuts (A, B): by B's rows (column-parallel) or A's columns (row-parallel)
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class HostAdapter:
    adapter: LoRAAdapter
    spec: AdapterSpec
    # layer -> module -> (A [r, in on this rank], B [out on this rank, r] scaled), in the model's dtype;
    # the routed experts' (A [E, r, in], B [E, out, r])
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]


class AdapterReader:
    """What reading one adapter for this worker needs: limits, the model's shapes, this rank's cuts."""

    def __init__(self, max_rank: int, projections: dict[str, tuple[int, int]], num_layers: int,
                 rank_parts: Callable[[str], list[tuple[int, int]]], dtype: torch.dtype,
                 num_experts: Optional[int] = None, expert_rows: Optional[Callable[[str], torch.Tensor]] = None):
        """``rank_parts(module)``: the [start, end) ranges of the module's split dimension (B's rows,
        or A's columns for ``ROW_PARALLEL``) this rank holds, concatenated in order. ``expert_rows(module)``:
        the same of a routed expert's module as an index (models/lora_experts.py), for a mixture of experts."""
        self.max_rank, self.projections, self.num_layers = max_rank, projections, num_layers
        self.rank_parts, self.dtype = rank_parts, dtype
        self.num_experts, self.expert_rows = num_experts, expert_rows

    def read(self, adapter: LoRAAdapter) -> HostAdapter:
        from safetensors.torch import load as load_safetensors

        spec = read_adapter(adapter.path, self.max_rank, self.projections, self.num_layers, self.num_experts)
        where = Path(spec.path)
        config, weights = (where / CONFIG_FILE).read_bytes(), (where / WEIGHTS_FILE).read_bytes()
        digest = hashlib.sha256(config + weights).hexdigest()
        if digest != adapter.digest or spec.digest != adapter.digest:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r} at {where}: its files changed since it was "
                                   f"registered (digest {digest[:12]}, registered {adapter.digest[:12]})")
        tensors = load_safetensors(weights)
        layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module, side), name in spec.tensor_names.items():
            if side != "A":
                continue
            rank, scaling = spec.modules[(layer, module)]
            a = tensors[name].float()
            b = tensors[spec.tensor_names[(layer, module, "B")]].float() * scaling
            if module in EXPERT_MODULES:
                a, b = self._experts(module, a, b, rank)
                layers.setdefault(layer, {})[module] = (a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
                continue
            parts = self.rank_parts(module)
            if module.rsplit(".", 1)[-1] in ROW_PARALLEL:
                a = torch.cat([a[:, lo:hi] for lo, hi in parts], dim=1)
            else:
                b = torch.cat([b[lo:hi] for lo, hi in parts], dim=0)
            layers.setdefault(layer, {})[module] = (a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
        return HostAdapter(adapter, spec, layers)

    def _experts(self, module: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """PEFT's A [r * E, in] and B [out, r * E] (expert e: A's rows e * r.., B's columns e::E) as
        [E, r, in] and [E, out, r], cut to this rank: down's inputs, gate_up's outputs."""
        if self.expert_rows is None:
            raise LoRAAdapterError(f"module {module!r}: this model has no routed experts to adapt")
        experts = a.shape[0] // rank
        a = a.view(experts, rank, -1)
        b = b.view(b.shape[0], rank, experts).permute(2, 0, 1)
        index = self.expert_rows(module)
        if module == "experts.down_proj":  # row-parallel: its inputs cut
            return a.index_select(2, index), b
        return a, b.index_select(1, index)


class HostAdapterCache:
    """Up to ``capacity`` adapters read (or being read) in host memory, by name."""

    def __init__(self, reader: AdapterReader, capacity: int):
        self.reader, self.capacity = reader, capacity
        self._entries: OrderedDict[str, Future] = OrderedDict()  # name -> Future[HostAdapter], oldest use first
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-prefetch")

    def prefetch(self, adapter: LoRAAdapter) -> None:
        """Start reading ``adapter`` in the background unless it is read or being read."""
        self._entry(adapter, background=True)

    def get(self, adapter: LoRAAdapter) -> HostAdapter:
        """The adapter read: at once if it is not (being) read; its read's error if it failed (and the
        failed read is dropped, so a later load tries the files again)."""
        entry = self._entry(adapter, background=False)
        try:
            return entry.result()
        except Exception:
            self._entries.pop(adapter.name, None)
            raise

    def forget(self, name: str) -> None:
        self._entries.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, adapter: LoRAAdapter, background: bool) -> Future:
        entry = self._entries.get(adapter.name)
        if entry is not None and (entry.done() and entry.exception() is None
                                  and entry.result().adapter.digest != adapter.digest):
            entry = None  # the name was registered again with other files
        if entry is None:
            if background:
                entry = self._pool.submit(self.reader.read, adapter)
            else:
                entry = Future()
                try:
                    entry.set_result(self.reader.read(adapter))
                except Exception as exc:
                    entry.set_exception(exc)
            self._entries[adapter.name] = entry
        self._entries.move_to_end(adapter.name)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def shard_parts(module: str, heads: tuple[int, int], kv_heads: tuple[int, int], intermediate: tuple[int, int],
                q_full: int, kv_full: int, inter_full: int) -> list[tuple[int, int]]:
    """This rank's ranges of ``module``'s split dimension, as the base layer cuts it
    (worker_proc/tensor_parallel.py): a fused module's parts each cut, one after another."""
    if module in ("q_proj", "o_proj"):
        return [heads]
    if module in ("k_proj", "v_proj"):
        return [kv_heads]
    if module in ("gate_proj", "up_proj", "down_proj"):
        return [intermediate]
    if module == "qkv_proj":
        return [heads, (q_full + kv_heads[0], q_full + kv_heads[1]),
                (q_full + kv_full + kv_heads[0], q_full + kv_full + kv_heads[1])]
    if module == "gate_up_proj":
        return [intermediate, (inter_full + intermediate[0], inter_full + intermediate[1])]
    raise LoRAAdapterError(f"module {module!r} has no tensor-parallel split here")

