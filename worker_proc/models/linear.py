"""The model's matmuls: F.linear, except for a step of few rows on CPU.

For a few rows (a decode step, the sampled rows through lm_head) oneMKL's x @ W.T streams
the weight more slowly than W @ x.T: on the 0.5B shape with 32 rows, 20-33% less time per
projection and lm_head, and a 32-request decode step ~17% faster (bench/RESULTS.md). The two
sum each dot product in a different order, so results differ from F.linear in the last
bits; greedy parity with transformers is checked by tests/test_model_parity.py. Large
prefill batches keep F.linear, which is as fast there and bit for bit HF's op.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# Measured per decode step (bench/step_profile.py --by-kind, 2 threads): W @ x.T won at 16
# and 32 rows on the small and 0.5B shapes, and lost at 64 rows on the small one.
SMALL_BATCH_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias): [rows, out], contiguous."""
    if x.device.type != "cpu" or x.shape[0] > SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)
