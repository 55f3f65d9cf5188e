"""The model's matmuls: F.linear, except on CPU, where the layout that streams fastest is used.

For a few rows (a decode step, the sampled rows through lm_head) oneMKL's x @ W.T streams
the weight more slowly than W @ x.T: on the 0.5B shape with 32 rows, 20-33% less time per
projection and lm_head, and a 32-request decode step ~17% faster (bench/RESULTS.md).

Above that, x @ W_t with W_t a contiguous [in, out] copy beats F.linear: on the small bench
shape, 64 rows, 16% less time for the layers' projections and 23% for lm_head (one thread,
bench/RESULTS.md). The copy doubles the weights' memory, so it is kept only for models
whose weights are small (``weight_layout``); larger ones decode in steps of few rows
anyway, where W @ x.T wins, and gain nothing from it in prefill (+3% at 512 rows).
Models small enough to stay in the caches (the demo, a few MB) take x @ W_t for few rows
too: 2-4x faster per matmul at 1-32 rows, where W @ x.T's advantage is in streaming.

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
# Up to this size they stay in the caches from step to step, where x @ W_t is 2-4x faster than
# W @ x.T at every row count (demo model, 1-32 rows); larger ones stream from memory each
# step, where W @ x.T streams a little faster for few rows (small shape, 16 rows: -5%).
CACHE_RESIDENT_MAX_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """How a model's matrices are kept on CPU (chosen once per model by its size)."""
    transposed: bool = False  # an [in, out] copy beside each [out, in] weight
    resident: bool = False  # small enough to stay cached: the copy serves every row count


@dataclass(slots=True)
class LinearWeight:
    weight: torch.Tensor  # [out, in], contiguous
    bias: Optional[torch.Tensor] = None  # [out]
    weight_t: Optional[torch.Tensor] = None  # [in, out] contiguous copy (CPU, small models)
    resident: bool = False  # use weight_t for few rows too

    @classmethod
    def of(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], layout: WeightLayout) -> "LinearWeight":
        return cls(weight, bias, weight.t().contiguous() if layout.transposed else None, layout.resident)


def weight_layout(device: torch.device, weight_bytes: int) -> WeightLayout:
    """How a model of ``weight_bytes`` of weights keeps its matrices."""
    if device.type != "cpu" or weight_bytes > TRANSPOSED_COPY_MAX_BYTES:
        return WeightLayout()
    return WeightLayout(transposed=True, resident=weight_bytes <= CACHE_RESIDENT_MAX_BYTES)


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias): [rows, out], contiguous."""
    if x.device.type != "cpu":
        return F.linear(x, w.weight, w.bias)
    if x.shape[0] <= SMALL_BATCH_ROWS and not w.resident:
        out = torch.mm(w.weight, x.t()).t().contiguous()
        return out if w.bias is None else out.add_(w.bias)
    if w.weight_t is not None:
        return torch.mm(x, w.weight_t) if w.bias is None else torch.addmm(w.bias, x, w.weight_t)
    return F.linear(x, w.weight, w.bias)
