"""Shape checks shared by the block-level kernels over ``kv_cache[layer, kind, block, slot, head, dim]``:
two kinds (K, V), or one (a latent attention's cache, which both are read from: worker_proc/kv_cache.py)."""

from __future__ import annotations

import torch


class KVCacheLayoutError(ValueError):
    """The cache tensor does not have the one-tensor-per-worker layout the kernels address."""


def check_kv_cache(kv_cache: torch.Tensor) -> int:
    """Raise unless ``kv_cache`` is a contiguous 6-d cache; return the elements in one block.

    The kernels address block ``b`` of layer-and-kind ``lk`` as ``lk * blocks * block_numel
    + b * block_numel``, which holds only for a contiguous tensor.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[1] not in (1, 2):
        raise KVCacheLayoutError(
            "kv_cache must be [num_layers, 2 (K, V) or 1 (latent), num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise KVCacheLayoutError("kv_cache must be one contiguous tensor (allocate it with torch.empty/zeros)")
    return kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.shape[5]
