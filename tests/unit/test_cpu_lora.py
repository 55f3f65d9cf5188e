"""kernels/cpu_lora.c, this CPU's build (LoRA's shrink and expand for tokens grouped by slot; the build for each
x86-64 level: tests/e2e/test_kernels_cpu_lora.py): against the exact product in float64 at 1..300 tokens mixing
slots and the base model, every dtype, odd K and output sizes, decodes spread over the slots and prompt chunks in
runs; the bits whatever the thread count; the refusals that keep its reads in bounds."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.models.lora_linear import LoRABatch
from support.lora_kernel_checks import DTYPES, RANKS, SHAPES, check_lora_kernel, token_slots
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

TOKENS = (1, 2, 3, 4, 5, 8, 17, 33, 64, 65, 131, 300)


@pytest.mark.parametrize("runs", [False, True], ids=["spread", "runs"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_token_takes_its_own_slots_delta_within_float32_sums(dtype, tokens, runs):
    for i, (k, outs, r_max) in enumerate(SHAPES):
        check_lora_kernel(token_slots(tokens, runs, seed=tokens + i), k, outs, r_max, dtype, seed=i)


def test_a_step_of_only_base_model_tokens_changes_nothing():
    check_lora_kernel(torch.full((7,), -1), 97, (64, 5, 70), 5, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_bits_do_not_depend_on_the_thread_count(dtype):
    """Each sum is one work item's, in one order, whatever the threads."""
    gen = torch.Generator().manual_seed(3)
    slots = token_slots(150, runs=False, seed=1)
    a = torch.randn(len(RANKS), 32, 896, generator=gen).to(dtype)
    bs = [torch.randn(len(RANKS), 16, out, generator=gen).to(dtype) for out in (896, 128)]
    x, y = torch.randn(150, 896, generator=gen).to(dtype), torch.randn(150, 1024, generator=gen).to(dtype)
    batch = LoRABatch.build(slots, torch.device("cpu"), len(RANKS), 16, dtype, (16, 16, 9, 16), "native")
    kernel = cpu_native.LoRAGroupKernel(a, bs, [0, 896], [True, True])

    def run() -> torch.Tensor:
        out = y.clone()
        kernel(x, out, batch.order, batch.seg_starts, batch.seg_slots, batch.ranks)
        return out

    outs = results_at_thread_counts(run)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_mismatched_weights_and_inputs_are_an_error_not_a_wild_read():
    a, b = torch.zeros(4, 16, 64, dtype=torch.bfloat16), torch.zeros(4, 8, 32, dtype=torch.bfloat16)
    for bad in (lambda: cpu_native.LoRAGroupKernel(a, [b], [0], [True]),  # 16 rows of A for one module of rank 8
                lambda: cpu_native.LoRAGroupKernel(a[:, :8], [b], [0], [True]),  # A not contiguous
                lambda: cpu_native.LoRAGroupKernel(a[:, :8].contiguous(), [b.float()], [0], [True])):  # dtypes
        with pytest.raises(ValueError):
            bad()
    kernel = cpu_native.LoRAGroupKernel(a[:, :8].contiguous(), [b], [2], [True])
    index = torch.zeros(1, dtype=torch.int64)
    starts, ranks = torch.tensor([0, 1]), torch.full((4,), 8)
    for x, y in ((torch.zeros(1, 63, dtype=torch.bfloat16), torch.zeros(1, 34, dtype=torch.bfloat16)),  # K differs
                 (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 33, dtype=torch.bfloat16)),  # y too narrow
                 (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(1, 34, dtype=torch.bfloat16)),  # rows differ
                 (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 68, dtype=torch.bfloat16)[:, ::2])):  # columns
        with pytest.raises(ValueError):
            kernel(x, y, index, starts, index, ranks)
