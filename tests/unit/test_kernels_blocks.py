"""Block-level Triton kernels (zero, copy, swap, write_kv) match their torch references.

The Triton kernels run under TRITON_INTERPRET=1 on CPU, or natively on a GPU (see
kernel_device). Every destination is poisoned with NaN first, and blocks the kernel must
not touch are compared bit for bit, so a missed or stray write fails.
"""

from support.kernel_device import DEVICE, MARKS, synchronize, to_device  # first: it decides TRITON_INTERPRET

import pytest
import torch

from pagedserve.kernels import ops, reference, triton_ops
from pagedserve.kernels import swap
from pagedserve.kernels.swap import block_runs, swap_plan

pytestmark = MARKS

BIT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (num_layers, num_blocks, block_size, kv_heads, head_dim, dtype): odd sizes, non-power-of-2 dims.
CACHE_SHAPES = [
    (2, 9, 1, 3, 40, torch.float32),
    (3, 7, 3, 2, 16, torch.bfloat16),
    (1, 5, 16, 1, 32, torch.float32),
]


def host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """A host cache as the worker allocates one: pinned beside a GPU, so swaps are real DMA."""
    return tensor.pin_memory() if DEVICE.type == "cuda" else tensor


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN compares equal to the same NaN."""
    return tensor.contiguous().view(BIT_VIEW[tensor.dtype])


def random_cache(shape, generator: torch.Generator, nan_blocks=()) -> torch.Tensor:
    num_layers, num_blocks, block_size, heads, dim, dtype = shape
    cache = torch.randn(num_layers, 2, num_blocks, block_size, heads, dim, generator=generator).to(dtype)
    for block in nan_blocks:
        cache[:, :, block] = float("nan")
    return cache


@pytest.mark.parametrize("shape", CACHE_SHAPES)
def test_zero_blocks_zeroes_listed_blocks_in_every_layer_and_leaves_the_rest_bit_identical(shape):
    generator = torch.Generator().manual_seed(1)
    cache, block_ids = to_device(
        random_cache(shape, generator, nan_blocks=(0, 4)), torch.tensor([4, 1, shape[1] - 1, 0], dtype=torch.int32)
    )
    expected = cache.clone()

    triton_ops.zero_blocks(cache, block_ids)
    reference.zero_blocks(expected, block_ids)

    assert torch.equal(bits(cache), bits(expected))
    assert not cache[:, :, block_ids.long()].any()


def test_zero_blocks_with_no_ids_changes_nothing():
    cache = random_cache(CACHE_SHAPES[0], torch.Generator().manual_seed(2), nan_blocks=(3,)).to(DEVICE)
    before = bits(cache).clone()
    triton_ops.zero_blocks(cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(bits(cache), before)


@pytest.mark.parametrize("shape", CACHE_SHAPES[:2])
def test_copy_blocks_copies_every_pair_across_layers_and_leaves_the_rest_bit_identical(shape):
    generator = torch.Generator().manual_seed(3)
    num_blocks = shape[1]
    destinations = (num_blocks - 1, 2, 5)
    mapping = torch.tensor([[0, destinations[0]], [3, destinations[1]], [0, destinations[2]]])
    cache, mapping = to_device(random_cache(shape, generator, nan_blocks=destinations), mapping)
    expected = cache.clone()

    triton_ops.copy_blocks(cache, mapping)
    reference.copy_blocks(expected, mapping)

    assert torch.equal(bits(cache), bits(expected))
    assert not cache.isnan().any()


def test_block_runs_merge_pairs_whose_source_and_destination_both_advance_by_one():
    mapping = torch.tensor([[4, 0], [5, 1], [6, 2], [9, 3], [2, 7], [3, 8]])
    assert block_runs(mapping) == [(4, 0, 3), (9, 3, 1), (2, 7, 2)]


@pytest.mark.parametrize("shape", CACHE_SHAPES[:2])
def test_swap_blocks_moves_blocks_between_caches_of_different_sizes(shape):
    generator = torch.Generator().manual_seed(4)
    device_cache = random_cache(shape, generator).to(DEVICE)
    host_shape = (shape[0], shape[1] + 6, *shape[2:])
    host_cache = host_memory(random_cache(host_shape, generator, nan_blocks=range(host_shape[1])))
    expected_host = host_cache.clone()
    swap_out = torch.tensor([[1, 10], [2, 11], [3, 12], [0, 4], [6, 0]])  # on the host, as the worker passes it

    triton_ops.swap_blocks(device_cache, host_cache, swap_out)
    synchronize()  # a swap-out into pinned memory lands asynchronously
    reference.swap_blocks(device_cache, expected_host, swap_out)
    assert torch.equal(bits(host_cache), bits(expected_host))

    expected_device = device_cache.clone()
    swap_in = torch.tensor([[12, 5], [4, 4], [0, 3]])
    triton_ops.swap_blocks(host_cache, device_cache, swap_in)
    reference.swap_blocks(host_cache, expected_device, swap_in)
    assert torch.equal(bits(device_cache), bits(expected_device))


def test_a_swap_stages_on_the_device_side_when_that_saves_copies():
    scattered_to_run = torch.tensor([[7, 0], [2, 1], [5, 2], [0, 3]])  # device blocks anywhere, host in a run
    assert swap_plan(scattered_to_run, may_gather=True, may_scatter=False) == "gather"  # 1 copy run, not 4
    assert swap_plan(scattered_to_run.flip(1), may_gather=False, may_scatter=True) == "scatter"
    assert swap_plan(scattered_to_run, may_gather=False, may_scatter=False) == "direct"
    both_runs = torch.tensor([[4, 0], [5, 1], [6, 2]])
    assert swap_plan(both_runs, may_gather=True, may_scatter=True) == "direct"  # a tie needs no staging


@pytest.mark.parametrize("stage_bytes", [swap.STAGE_BYTES, 1])  # 1: every block its own staged chunk
def test_staged_swaps_of_scattered_device_blocks_equal_the_reference(monkeypatch, stage_bytes):
    monkeypatch.setattr(swap, "STAGE_BYTES", stage_bytes)
    shape = CACHE_SHAPES[0]
    generator = torch.Generator().manual_seed(8)
    device_cache = random_cache(shape, generator).to(DEVICE)
    host_cache = host_memory(random_cache((shape[0], 12, *shape[2:]), generator, nan_blocks=range(12)))
    expected_host = host_cache.clone()
    swap_out = torch.tensor([[8, 3], [1, 4], [5, 5], [0, 6], [3, 7]])  # scattered on the device side
    assert swap_plan(swap_out, may_gather=True, may_scatter=False) == "gather"

    triton_ops.swap_blocks(device_cache, host_cache, swap_out)
    synchronize()
    reference.swap_blocks(device_cache, expected_host, swap_out)
    assert torch.equal(bits(host_cache), bits(expected_host))

    device_cache[:, :, [2, 4, 6, 7]] = float("nan")
    expected_device = device_cache.clone()
    swap_in = torch.tensor([[4, 7], [5, 2], [6, 6], [7, 4]])
    triton_ops.swap_blocks(host_cache, device_cache, swap_in)
    reference.swap_blocks(host_cache, expected_device, swap_in)
    assert torch.equal(bits(device_cache), bits(expected_device))
    assert not device_cache.isnan().any()


def test_swap_blocks_rejects_a_block_id_outside_either_cache():
    shape = CACHE_SHAPES[0]
    device_cache = random_cache(shape, torch.Generator().manual_seed(6)).to(DEVICE)
    host_cache = host_memory(torch.zeros_like(device_cache, device="cpu"))
    with pytest.raises(IndexError, match="outside the caches"):
        triton_ops.swap_blocks(device_cache, host_cache, torch.tensor([[shape[1] - 1, 0], [shape[1], 1]]))


@pytest.mark.parametrize(
    "block_size, heads, dim, key_dtype, cache_dtype",
    [(1, 3, 40, torch.float32, torch.float32), (3, 2, 16, torch.float32, torch.bfloat16), (16, 1, 32, torch.bfloat16, torch.bfloat16)],
)
def test_write_kv_fills_each_slot_and_skips_padding(block_size, heads, dim, key_dtype, cache_dtype):
    generator = torch.Generator().manual_seed(5)
    num_tokens = 7
    num_blocks = 2 + -(-num_tokens // block_size)
    # key and value are strided slices of one fused projection output, as a model produces them.
    fused = torch.randn(num_tokens, 3 * heads, dim, generator=generator).to(key_dtype)
    caches = torch.full((2, num_blocks, block_size, heads, dim), float("nan"), dtype=cache_dtype)
    total_slots = num_blocks * block_size
    slots = torch.randperm(total_slots, generator=generator)[:num_tokens]
    slots[2] = -1
    fused, caches, slots = to_device(fused, caches, slots)
    key, value = fused[:, heads : 2 * heads], fused[:, 2 * heads :]
    expected = caches.clone()

    triton_ops.write_kv(key, value, caches[0], caches[1], slots)
    reference.write_kv(key, value, expected[0], expected[1], slots)

    assert torch.equal(bits(caches), bits(expected))
    assert caches.isnan().sum() == 2 * (total_slots - (num_tokens - 1)) * heads * dim


def test_select_ops_uses_triton_on_cuda_and_references_on_cpu_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(ops.KERNELS_ENV, raising=False)
    assert ops.select_ops("cpu") is reference
    assert ops.select_ops("cuda") is triton_ops
    monkeypatch.setenv(ops.KERNELS_ENV, "torch")
    assert ops.select_ops("cuda") is reference
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    assert ops.select_ops(DEVICE) is triton_ops  # on CPU only because the interpreter is on
    monkeypatch.setenv(ops.KERNELS_ENV, "cudnn")
    with pytest.raises(ops.KernelSelectionError, match="'triton' or 'torch'"):
        ops.select_ops("cpu")


def test_select_ops_refuses_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set only for the CPU run
    with pytest.raises(ops.KernelSelectionError, match="TRITON_INTERPRET=1"):
        ops.select_ops("cpu")


def test_a_latent_cache_of_one_kind_is_zeroed_copied_and_swapped_as_the_reference_does():
    """Multi-head latent attention's cache keeps one row a token, no V (worker_proc/kv_cache.py
    ``KVCacheSpec.latent``): [layers, 1, blocks, slot, 1, L + R]."""
    generator = torch.Generator().manual_seed(7)
    cache = torch.randn(3, 1, 9, 4, 1, 36, generator=generator)
    cache[:, :, 6] = float("nan")
    host = host_memory(torch.full((3, 1, 5, 4, 1, 36), float("nan")))
    cache, zero, copy = to_device(cache, torch.tensor([6, 2]), torch.tensor([[0, 6], [3, 8]]))
    expected = cache.clone()
    triton_ops.zero_blocks(cache, zero)
    reference.zero_blocks(expected, zero)
    triton_ops.copy_blocks(cache, copy)
    reference.copy_blocks(expected, copy)
    assert torch.equal(bits(cache), bits(expected)) and not cache.isnan().any()
    triton_ops.swap_blocks(cache, host, torch.tensor([[8, 4], [1, 0]]))
    assert torch.equal(bits(host[:, :, [4, 0]]), bits(expected[:, :, [8, 1]].cpu()))
