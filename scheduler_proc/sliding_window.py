"""Sliding-window block freeing: which of a sequence's blocks no future query can read.

A model whose every layer attends only ``window`` positions back (Mistral with ``sliding_window``,
Qwen2 with the window on all layers) reads, for a query at position ``p``, the keys at positions
``p - window + 1 .. p`` (worker_proc/decode_attention.py, prefill_attention.py and the Triton
kernel all start their key loops there). Queries only move forward, so a block that lies wholly
before ``p - window`` is dead for good: the block manager gives it back to the pool as the
sequence advances (vLLM's sliding-window KV manager does the same), and a long generation holds
``ceil(window / block_size) + 1`` blocks instead of ``length / block_size``.

A freed entry of a block table becomes the *null block*, a device block reserved at start that is
never handed out, written or zeroed (vLLM's null block): a table sent to the workers after a swap-in
names it where blocks were freed, and any stray read of it stays in bounds. The workers' own copy
of a running sequence's table keeps the old ids (tables only grow on the wire); the attention
kernels never reach those positions, so a block reused by another sequence cannot change this one's
tokens (tests/e2e/test_sliding_window_e2e.py checks it with a poisoned cache).

Where sliding and full layers mix (Gemma 2/3, gpt-oss), a full layer reads every block. Where the
workers lay their cache out in KV groups (the hello's ``hybrid_kv``, protocol/kv_groups.py), a
sequence holds one table per group and only the local groups' tables free their blocks behind
the window, as above (block_manager.py); otherwise every block is kept.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagedserve.protocol.kv_groups import KVGroups, kv_groups


def hybrid_groups(layer_windows: Sequence[int], hybrid_kv: bool) -> Optional[KVGroups]:
    """The KV groups the scheduler keeps tables for: those the workers laid their cache out in
    (``hybrid_kv`` in their hello), None for one table."""
    return kv_groups(layer_windows) if hybrid_kv else None


def window_to_free(layer_windows: Sequence[int], draft_model: bool,
                   hybrid_kv: bool = False) -> tuple[int, Optional[str]]:
    """The window behind which blocks are freed (0: none) and the line the log says about it once.

    ``layer_windows``: each layer's window as the workers' hello says it, 0 for full attention
    ([]: an older worker, nothing known). Every layer windowed: the largest window. A draft model
    (speculative decoding) shares the block tables and its layers may read everything, so blocks
    are kept with one. ``hybrid_kv``: the workers' cache is in KV groups (``hybrid_groups``)."""
    windowed = [w for w in layer_windows if w > 0]
    if not windowed:
        return 0, None
    groups = kv_groups(layer_windows) if hybrid_kv else None
    if groups is not None:
        return 0, (f"{len(windowed)} of {len(layer_windows)} layers attend within {groups.window} positions: "
                   f"their {groups.num_window_groups} KV group(s) free blocks behind the window, the global "
                   f"group of {groups.group_size} layers keeps every block")
    if len(windowed) < len(layer_windows):
        return 0, (f"{len(windowed)} of {len(layer_windows)} layers attend within a sliding window, the others to "
                   f"every position: every KV block is kept (the workers' cache is not in KV groups: "
                   f"PAGEDSERVE_HYBRID_KV=0, a draft model, the transformers backend, or windows that "
                   f"protocol/kv_groups.py does not group)")
    window = max(windowed)
    if draft_model:
        return 0, (f"every layer attends within {window} positions, but the draft model reads the same block "
                   f"tables: every KV block is kept")
    return window, f"every layer attends within {window} positions: KV blocks behind the window are freed"


def blocks_behind(position: int, window: int, block_size: int) -> int:
    """How many leading blocks lie wholly before ``position - window``: no query at ``position``
    or later reads them (a query at ``q`` reads keys from ``q - window + 1`` on)."""
    return max(0, (position - window) // block_size)


def max_live_blocks(window: int, block_size: int) -> int:
    """The most blocks a windowed sequence computing one token a step holds: those from the one
    holding ``position - window`` through the one ``position`` goes into. Freed when it takes a new
    block, it holds the same count until the next: ``position - window`` crosses a block boundary
    at most once per block. (A prompt chunk holds its own blocks too, for that step.)"""
    return -(-window // block_size) + 1
