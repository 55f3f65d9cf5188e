"""The CPU's native KV write (kernels/cpu_write_kv.c through cpu_native.write_kv, the dense layer's on CPU in half
precision): the cache the torch form (kernels/reference.py) leaves, byte for byte, strided rows and padding slots
included; tensors it does not take left to the caller; a slot past the cache refused before any row is written."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, reference

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


def caches(dtype, blocks=6, block_size=4, heads=2, dim=8):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(blocks, block_size, heads, dim, generator=gen).to(dtype)
    return k, torch.randn(k.shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_native_write_leaves_the_cache_the_torch_form_leaves(dtype):
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 3 * 16 + 7, generator=gen).to(dtype)  # k and v as views of a fused row, strided
    key, value = qkv[:, :16].view(5, 2, 8), qkv[:, 16:32].view(5, 2, 8)
    slots = torch.tensor([0, 23, -1, 9, 10])
    k_native, v_native = caches(dtype)
    k_torch, v_torch = caches(dtype)
    assert cpu_native.write_kv(key, value, k_native, v_native, slots)
    reference.write_kv(key, value, k_torch, v_torch, slots)
    assert torch.equal(k_native, k_torch) and torch.equal(v_native, v_torch)


def test_a_slot_past_the_cache_is_an_error_and_nothing_is_written():
    k_cache, v_cache = caches(torch.bfloat16)
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(2, 2, 8).bfloat16()
    with pytest.raises(IndexError):
        cpu_native.write_kv(key, key, k_cache, v_cache, torch.tensor([1, 24]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_tensors_it_does_not_take_are_left_to_the_caller():
    k_cache, v_cache = caches(torch.bfloat16)
    key = torch.randn(2, 2, 8).bfloat16()
    for k, slots in ((key.float(), torch.tensor([1, 2])),  # another dtype than the cache's
                     (key, torch.tensor([1, 2], dtype=torch.int32)),
                     (key.transpose(1, 2).contiguous().transpose(1, 2), torch.tensor([1, 2]))):  # heads strided
        assert not cpu_native.write_kv(k, k, k_cache, v_cache, slots)
