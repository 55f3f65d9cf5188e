"""The model's matmuls: F.linear, except on CPU, where the layout that streams fastest is used.

For a few rows (a decode step, the sampled rows through lm_head) oneMKL's x @ W.T streams
the weight more slowly than W @ x.T: on the 0.5B shape with 32 rows, 20-33% less time per
projection and lm_head, and a 32-request decode step ~17% faster (bench/RESULTS.md).

Above that, x @ W_t with W_t a contiguous [in, out] copy beats F.linear: on the small bench
shape, 64 rows, 16% less time for the layers' projections and 23% for lm_head (one thread,
bench/RESULTS.md). The copy doubles the weights' memory, so it is kept only for models
whose weights are small (``keeps_transposed``); larger ones decode in steps of few rows
anyway, where W @ x.T wins, and gain nothing from it in prefill (+3% at 512 rows).

W @ x.T and x @ W_t sum some dot products in a different order than F.linear, so results
may differ from it in the last bits; greedy parity with transformers is checked by
tests/test_model_parity.py and the bench's identical-output count. Large prefill batches
without the copy keep F.linear, which is as fast there and bit for bit HF's op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

# Measured per decode step (bench/step_profile.py --by-kind, 2 threads): W @ x.T won at 16
# and 32 rows on the small and 0.5B shapes, and lost at 64 rows on the small one.
SMALL_BATCH_ROWS = 32
# Weights (all of them, lm_head included) up to this size also keep a transposed copy on CPU.
TRANSPOSED_COPY_MAX_BYTES = 512 << 20


@dataclass(slots=True)
class LinearWeight:
    weight: torch.Tensor  # [out, in], contiguous
    bias: Optional[torch.Tensor] = None  # [out]
    weight_t: Optional[torch.Tensor] = None  # [in, out] contiguous copy (CPU, small models)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool) -> "LinearWeight":
        return cls(weight, bias, weight.t().contiguous() if transposed else None)


def keeps_transposed(device: torch.device, weight_bytes: int) -> bool:
    """Whether a model of ``weight_bytes`` of weights keeps the [in, out] copies."""
    return device.type == "cpu" and weight_bytes <= TRANSPOSED_COPY_MAX_BYTES


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias): [rows, out], contiguous."""
    if x.device.type != "cpu":
        return F.linear(x, w.weight, w.bias)
    if x.shape[0] <= SMALL_BATCH_ROWS:
        out = torch.mm(w.weight, x.t()).t().contiguous()
        return out if w.bias is None else out.add_(w.bias)
    if w.weight_t is not None:
        return torch.mm(x, w.weight_t) if w.bias is None else torch.addmm(w.bias, x, w.weight_t)
    return F.linear(x, w.weight, w.bias)
