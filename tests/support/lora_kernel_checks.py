"""Checks of kernels/cpu_lora.c (``cpu_native.LoRAGroupKernel``) against the exact product in float64, shared by
the in-process test of this CPU's build (tests/unit/test_kernels_lora.py) and the one over every x86-64 level's
build (tests/e2e/test_kernels_cpu_lora.py)."""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.models.lora_linear import LoRABatch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the slots' adapter ranks: below the slots' rank, odd, and an empty slot (rank 0) that tokens may still name
RANKS = (8, 3, 5, 0)
# (K, each module's output columns, the slots' rank R): K around a vector of bfloat16 (32) and the shrink's
# 64-element steps, outputs short of a vector, one vector, past a 64-column tile; R = 8 gives a long block's
# four rows of A at a time, R = 5 and R = 6 (a group of four rows would span two modules) not
SHAPES = ((40, (37, 16, 16), 8), (97, (64, 5, 70), 5), (200, (130,), 8), (64, (33, 48), 6))


def token_slots(count: int, runs: bool, seed: int) -> torch.Tensor:
    """``count`` tokens' slots (-1: the base model): drawn at random (decodes), or in runs of one slot (prompt
    chunks: past a block of 16 and of 64 tokens where ``count`` is)."""
    gen = torch.Generator().manual_seed(seed)
    if not runs:
        return torch.randint(-1, len(RANKS), (count,), generator=gen)
    bounds = sorted(torch.randint(0, count + 1, (len(RANKS),), generator=gen).tolist())
    slots = torch.full((count,), -1)
    for slot, (first, last) in enumerate(zip(bounds, bounds[1:] + [count])):
        slots[first:last] = (slot + 1) % len(RANKS) - 1  # -1, 0, 1, 2 in turn
    return slots


def check_lora_kernel(slots: torch.Tensor, k: int, outs: tuple[int, ...], r_max: int, dtype: torch.dtype,
                      seed: int = 0) -> None:
    """Each adapter token's output columns of each module take (x A_j^T) B_j of its slot's adapter, within the
    float32 sums' worst-case bound of the exact product ((K + R) eps sum|x||A||B|) and one rounding to y's dtype;
    the base model's rows and the columns no module owns stay as they were, bit for bit. x's and y's rows are
    strided (a fused output's columns), the modules' columns apart."""
    gen = torch.Generator().manual_seed(seed)
    ranks = tuple(min(r, r_max) for r in RANKS)
    tokens, modules, slot_count = slots.shape[0], len(outs), len(ranks)

    def weights(*shape: int, rank_dim: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=gen) * 0.3
        for slot, rank in enumerate(ranks):  # rows past an adapter's rank are zeros, as LoRAProjection keeps them
            w[slot].narrow(rank_dim, rank, r_max - rank).zero_()
        return w.to(dtype)

    a = weights(slot_count, modules, r_max, k, rank_dim=1)
    bs = [weights(slot_count, r_max, out, rank_dim=0) for out in outs]
    columns = [3 + sum(outs[:j]) + j for j in range(modules)]  # a column apart, none at 0
    width = columns[-1] + outs[-1] + 2
    x = torch.randn(2 * tokens, k, generator=gen).to(dtype)[::2]
    y = torch.randn(tokens, width + 6, generator=gen).to(dtype)[:, 4:4 + width]
    batch = LoRABatch.build(slots, torch.device("cpu"), slot_count, r_max, dtype, ranks, "native")
    kernel = cpu_native.LoRAGroupKernel(a.view(slot_count, modules * r_max, k), bs, columns, [True] * modules)
    got = y.clone()
    if batch.order.numel():
        kernel(x, got, batch.order, batch.seg_starts, batch.seg_slots, batch.ranks)

    exact, magnitude = y.double().clone(), torch.zeros(tokens, width, dtype=torch.float64)
    owned = torch.zeros(width, dtype=torch.bool)
    for j, (col, out) in enumerate(zip(columns, outs)):
        owned[col:col + out] = True
        for slot in range(slot_count):
            rows = (slots == slot).nonzero().flatten()
            xs, aj, bj = x[rows].double(), a[slot, j].double(), bs[j][slot].double()
            exact[rows, col:col + out] += (xs @ aj.t()) @ bj
            magnitude[rows, col:col + out] = (xs.abs() @ aj.abs().t()) @ bj.abs()
    base = slots < 0
    assert torch.equal(got[base], y[base]), "the base model's rows changed"
    assert torch.equal(got[:, ~owned], y[:, ~owned]), "columns outside the modules changed"
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    sums = (k + r_max + 2) * 2.0 ** -24 * magnitude
    bound = sums + ulp * (exact.abs() + sums) + 1e-30
    error = (got.double() - exact).abs()
    worst = (error / bound)[~base].max().item() if (~base).any() else 0.0
    assert worst <= 1.0, f"off by {worst:.2f} of the bound ({dtype}, K {k}, outs {outs}, R {r_max}, {tokens} tokens)"
