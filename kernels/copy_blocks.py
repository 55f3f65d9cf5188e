"""Triton copy-on-write of KV blocks: every (src, dst) pair, every layer, K and V, in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.cache_layout import check_kv_cache
from pagedserve.kernels.device_indices import to_device_indices

MAX_CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(cache_ptr, mapping_ptr, layer_kind_stride, block_numel, CHUNK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    src_block = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    layer_kind_base = cache_ptr + tl.program_id(1).to(tl.int64) * layer_kind_stride
    offsets = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    in_block = offsets < block_numel
    values = tl.load(layer_kind_base + src_block * block_numel + offsets, mask=in_block)
    tl.store(layer_kind_base + dst_block * block_numel + offsets, values, mask=in_block)


def copy_blocks(kv_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Copy block ``mapping[i, 0]`` onto block ``mapping[i, 1]`` in every layer, K and V.

    The pairs run in parallel, so no destination may also be a source in the same mapping
    (copy-on-write always copies a shared block onto a fresh one, so this holds).
    """
    if mapping.numel() == 0:
        return
    block_numel = check_kv_cache(kv_cache)
    pairs = to_device_indices(mapping.reshape(-1, 2), kv_cache.device)
    chunk = min(triton.next_power_of_2(block_numel), MAX_CHUNK)
    grid = (pairs.shape[0], kv_cache.shape[0] * kv_cache.shape[1], triton.cdiv(block_numel, chunk))
    layer_kind_stride = kv_cache.shape[2] * block_numel
    _copy_blocks_kernel[grid](kv_cache, pairs, layer_kind_stride, block_numel, CHUNK=chunk)
