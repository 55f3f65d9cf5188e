"""Triton zeroing of freshly allocated KV blocks: one launch for every listed block, layer, K and V.

Why zero at all: a block handed out fresh may hold NaN from an earlier owner, and attention
kernels that mask by multiplying by zero turn that NaN into a NaN output (0 * NaN = NaN).
The cache is one contiguous tensor, so every layer's K or V block sits at a fixed stride
from the previous one and a single grid over (block, layer-and-kind, chunk) covers them all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.cache_layout import check_kv_cache
from pagedserve.kernels.device_indices import to_device_indices

MAX_CHUNK = 4096


@triton.jit
def _zero_blocks_kernel(cache_ptr, block_ids_ptr, layer_kind_stride, block_numel, CHUNK: tl.constexpr):
    block_id = tl.load(block_ids_ptr + tl.program_id(0)).to(tl.int64)
    layer_kind = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    base = cache_ptr + layer_kind * layer_kind_stride + block_id * block_numel
    zeros = tl.zeros((CHUNK,), dtype=cache_ptr.dtype.element_ty)
    tl.store(base + offsets, zeros, mask=offsets < block_numel)


def zero_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Zero the listed blocks in every layer, K and V (same contract as the reference)."""
    if block_ids.numel() == 0:
        return
    block_numel = check_kv_cache(kv_cache)
    ids = to_device_indices(block_ids.reshape(-1), kv_cache.device)
    num_layer_kinds = kv_cache.shape[0] * kv_cache.shape[1]
    chunk = min(triton.next_power_of_2(block_numel), MAX_CHUNK)
    grid = (ids.numel(), num_layer_kinds, triton.cdiv(block_numel, chunk))
    layer_kind_stride = kv_cache.shape[2] * block_numel
    _zero_blocks_kernel[grid](kv_cache, ids, layer_kind_stride, block_numel, CHUNK=chunk)
