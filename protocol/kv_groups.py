"""KV-cache groups of a model whose global and local (sliding-window) layers alternate: one rule
for the worker, which lays out its cache by it, and the scheduler, which keeps a block table per group.

Gemma 2/3 and gpt-oss mix layers that attend to every position with layers that attend only
``window`` positions back. A local layer's blocks behind its window are dead, a global layer's
never are, so one table for all layers must keep every block. As vLLM's hybrid KV cache manager
(vllm/v1/core/kv_cache_utils.py), the layers are cut into groups of ``group_size`` layers of one
kind: group 0 holds the global layers, groups 1.. the local ones (the last padded where the
counts do not divide). The device cache holds ``group_size`` layer slots, and a block id names
one page in each slot: the page belongs to whichever group's table holds the id. So every group
draws on one pool of equal-sized blocks, and a sequence holds one table per group: the global
table keeps every block, the local tables free theirs behind the window
(scheduler_proc/sliding_window.py).

Only ``group_size = number of global layers`` is laid out, with at least as many local layers
(every such model has fewer global layers) and one window for all local layers; anything else is
not hybrid (``None``): one table, every block kept, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True, slots=True)
class KVGroups:
    group_size: int  # layer slots of the device cache: the global layers' count
    num_window_groups: int  # groups of local layers; the tables a sequence holds beyond the global one
    window: int  # the local layers' window
    layer_slots: tuple[tuple[int, int], ...]  # per layer: (group, slot); group 0 is the global group

    @property
    def num_groups(self) -> int:
        return 1 + self.num_window_groups


def kv_groups(layer_windows: Sequence[int]) -> Optional[KVGroups]:
    """The groups of a model with these per-layer windows (0: global), or None where it is not
    hybrid as this engine lays it out (see the module docstring)."""
    global_layers = [i for i, w in enumerate(layer_windows) if w <= 0]
    local_layers = [i for i, w in enumerate(layer_windows) if w > 0]
    if not global_layers or not local_layers or len(local_layers) < len(global_layers):
        return None
    windows = {layer_windows[i] for i in local_layers}
    if len(windows) != 1:
        return None
    size = len(global_layers)
    slots: list[tuple[int, int]] = [(0, 0)] * len(layer_windows)
    for slot, layer in enumerate(global_layers):
        slots[layer] = (0, slot)
    for j, layer in enumerate(local_layers):
        slots[layer] = (1 + j // size, j % size)
    return KVGroups(size, -(-len(local_layers) // size), windows.pop(), tuple(slots))
