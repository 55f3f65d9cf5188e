"""Triton reshape-and-cache: each new token's K and V rows go into their paged slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride,
    block_size, num_heads, head_dim,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to cache
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    inside = (heads < num_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=inside)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=inside)
    cache_offsets = (slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
    cache_offsets += heads * cache_head_stride + dims
    tl.store(k_cache_ptr + cache_offsets, key, mask=inside)
    tl.store(v_cache_ptr + cache_offsets, value, mask=inside)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[t]``/``value[t]`` ([T, kv_heads, dim]) into flat slot ``slot_mapping[t]``; -1 is skipped.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output) as long as
    the last dimension is contiguous; the caches are one layer's [blocks, block_size, heads, dim].
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous head_dim")
    if slot_mapping.shape != (num_tokens,) or value.shape != key.shape:
        raise ValueError(
            f"write_kv needs key and value of one shape [T, heads, dim] and one slot per token; got key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    # Cast on the torch side, as the reference does, so rounding is bit-identical to it
    # (the Triton interpreter truncates fp32 -> bf16 where torch rounds to nearest even).
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    slots = slot_mapping.to(device=key.device).contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_heads, head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )
