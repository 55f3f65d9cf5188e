"""LoRA's shrink and expand: the Triton BGMV / SGMV kernels (kernels/lora.py) against the torch
references, and every delta path of a layer's projection (worker_proc/models/lora_linear.py: the native
grouped kernel, the dense masked matmuls, the segments, the Triton paths) against a per-token product
of the adapters' own A and B. The Triton kernels run under TRITON_INTERPRET=1 on CPU (or on CUDA,
support/kernel_device.py)."""

from support.kernel_device import DEVICE, MARKS, to_device  # first: it decides TRITON_INTERPRET

import pytest
import torch

from pagedserve.kernels import cpu_native, reference, triton_ops
from pagedserve.worker_proc.models.lora_linear import LoRABatch, LoRAProjection

pytestmark = MARKS

SLOTS, RANK = 4, 8


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = dict(rtol=1e-4, atol=1e-4) if actual.dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bgmv_shrink_and_expand_match_the_reference(dtype):
    tokens, k, out = 9, 72, 40
    slots = torch.tensor([2, -1, 0, 3, 2, 2, -1, 1, 0])
    x, a, b = randn(tokens, k, dtype=dtype), randn(SLOTS, 2 * RANK, k, dtype=dtype, seed=1), \
        randn(SLOTS, RANK, out, dtype=dtype, seed=2)
    y = randn(tokens, out + 8, dtype=dtype, seed=3)[:, 4:4 + out]  # a fused output's columns: strided rows
    s_ref = torch.zeros(tokens, 2 * RANK)
    reference.lora_shrink(x, a, slots, s_ref)
    y_ref = y.clone()
    reference.lora_expand(s_ref[:, RANK:], b, slots, y_ref)
    xd, ad, bd, yd_full, sd = to_device(x, a, b, y, torch.zeros(tokens, 2 * RANK))
    slots_d = slots.to(DEVICE)
    triton_ops.lora_shrink(xd, ad, slots_d, sd)
    triton_ops.lora_expand(sd[:, RANK:], bd, slots_d, yd_full)
    close(sd, s_ref)
    close(yd_full, y_ref)
    assert torch.equal(yd_full.cpu()[slots < 0], y[slots < 0])  # the base model's rows are untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_shrink_and_expand_over_sorted_segments_match_the_reference(dtype):
    k, out = 96, 70
    starts, seg_slots = torch.tensor([0, 5, 6, 23], dtype=torch.int32), torch.tensor([3, 0, 1], dtype=torch.int32)
    rows = 23
    x, a, b = randn(rows, k, dtype=dtype), randn(SLOTS, 3 * RANK, k, dtype=dtype, seed=1), \
        randn(SLOTS, RANK, out, dtype=dtype, seed=2)
    y = randn(rows, out, dtype=dtype, seed=3)
    s_ref, y_ref = torch.zeros(rows, 3 * RANK), y.clone()
    reference.lora_shrink_segments(x, a, starts, seg_slots, s_ref)
    reference.lora_expand_segments(s_ref[:, 2 * RANK:], b, starts, seg_slots, y_ref)
    xd, ad, bd, yd, sd, starts_d, slots_d = to_device(x, a, b, y, torch.zeros(rows, 3 * RANK), starts, seg_slots)
    triton_ops.lora_shrink_segments(xd, ad, starts_d, slots_d, sd, 17)
    triton_ops.lora_expand_segments(sd[:, 2 * RANK:], bd, starts_d, slots_d, yd, 17)
    close(sd, s_ref)
    close(yd, y_ref)


def _projection(dtype: torch.dtype, device: torch.device):
    """q/k/v-like modules of one input, slots holding adapters of ranks 8, 3 (q and v only) and 5, slot 3 empty;
    and the adapters' own (A, B) by slot and module."""
    modules = [("q_proj", 0, 32), ("k_proj", 32, 16), ("v_proj", 48, 16)]
    projection = LoRAProjection(modules, 40, SLOTS, RANK, dtype, device)
    adapters = {}
    for slot, (rank, names) in enumerate([(8, ("q_proj", "k_proj", "v_proj")), (3, ("q_proj", "v_proj")),
                                          (5, ("q_proj", "k_proj", "v_proj"))]):
        adapters[slot] = {name: (randn(rank, 40, dtype=dtype, seed=10 * slot + i),
                                 randn(size, rank, dtype=dtype, seed=10 * slot + i + 5))
                          for i, (name, _, size) in enumerate(modules) if name in names}
        projection.load(slot, {n: to_device(*pair) for n, pair in adapters[slot].items()})
    return projection, modules, adapters


def _expected(x, base, token_slots, modules, adapters):
    out = base.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        for name, start, size in modules:
            if slot >= 0 and name in adapters.get(slot, {}):
                a, b = adapters[slot][name]
                out[t, start:start + size] += (x[t].float() @ a.float().t()) @ b.float().t()
    return out


PATHS = ["native", "dense", "segments", "bgmv", "sgmv"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_slots", [[0, 1, -1, 2, 0, 1, 2, 2, -1, 0], [1, 1, 1, 1, 1, 1, 1, -1, 2, 2, 2, 2]],
                         ids=["interleaved", "runs"])
def test_every_delta_path_adds_each_tokens_own_adapter(path, dtype, token_slots):
    if path == "native" and not cpu_native.supports_lora():
        pytest.skip("the native CPU kernels are not built here (no C compiler)")
    device = DEVICE if path in ("bgmv", "sgmv") else torch.device("cpu")
    projection, modules, adapters = _projection(dtype, device)
    token_slots = torch.tensor(token_slots)
    x, base = randn(len(token_slots), 40, dtype=dtype, seed=7), randn(len(token_slots), 64, dtype=dtype, seed=8)
    batch = LoRABatch.build(token_slots, device, SLOTS, RANK, dtype, (8, 3, 5, 0), path)
    out = base.clone().to(device)
    projection.add_delta(x.to(device), out, batch, triton_ops)
    close(out, _expected(x, base, token_slots, modules, adapters))


def test_a_cleared_slot_adds_nothing_and_a_module_no_slot_targets_is_skipped():
    projection, modules, adapters = _projection(torch.float32, torch.device("cpu"))
    projection.clear(0)
    projection.clear(2)
    assert projection.num_targeting == [1, 0, 1]  # only slot 1 (q and v) is left
    token_slots = torch.tensor([0, 1, 2])
    x, base = randn(3, 40, seed=7), randn(3, 64, seed=8)
    out = base.clone()
    projection.add_delta(x, out, LoRABatch.build(token_slots, torch.device("cpu"), SLOTS, RANK, torch.float32,
                                                  (0, 3, 0, 0), "dense"))
    close(out, _expected(x, base, token_slots, modules, {1: adapters[1]}))
