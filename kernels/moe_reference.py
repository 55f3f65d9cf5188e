"""Plain-torch mixture of experts after routing: the oracle of the CPU grouped path and the Triton fused_moe.

Each active expert, in ascending order, runs its SwiGLU MLP over the tokens routed to it, and its
output, scaled by the routing weight, is added into the token's row: transformers' experts loop
(``MixtralExperts.forward``, ``Qwen2MoeExperts.forward``), op for op, so a token's experts are
summed in the same order and float32 results are transformers' bit for bit.

Weights are transformers' fused 3D layout: ``gate_up`` [E, 2 * I, H] (gate rows first, then up)
and ``down`` [E, H, I].

gpt-oss's experts (``GptOssExperts``) differ in three ways, each an argument here: biases on both
projections (``gate_up_bias`` [E, 2I], ``down_bias`` [E, H], added before the routing weight), and
the clamped SwiGLU (``ClampedSwiglu``) in place of SiLU. Its checkpoint interleaves gate and up
columns; the family's loader (worker_proc/models/gpt_oss.py) lays them out as gate rows then up rows.

``deltas`` adds LoRA adapters' deltas to each expert's two products (the worker's
models/lora_experts.py ``ExpertDeltas``; on a GPU, a step with expert adapters runs this loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: gate clamped above at ``limit``, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``GptOssExperts._apply_gate``'s ops, in their order and the inputs' dtype."""
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def gated(gate_up: torch.Tensor, size: int, activation: Optional[ClampedSwiglu]) -> torch.Tensor:
    """[rows, 2 * size] gate_up products (gate first) -> the input to down: silu(gate) * up, or
    ``activation``(gate, up)."""
    gate, up = gate_up.split(size, dim=-1)
    return F.silu(gate) * up if activation is None else activation(gate, up)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, gate_up_bias: Optional[torch.Tensor] = None,
              down_bias: Optional[torch.Tensor] = None, activation: Optional[ClampedSwiglu] = None,
              deltas: Optional[Any] = None) -> torch.Tensor:
    """x [T, H], routing ``weights`` / ``ids`` [T, top_k] (moe_routing.route) -> [T, H] in x's dtype.
    ``gate_up_bias`` [E, 2I] / ``down_bias`` [E, H]: each expert's biases (gpt-oss); ``activation``:
    None for SiLU. ``deltas``: ``mask(tokens)`` of an expert's rows (None: no adapter), then ``add(0 | 1,
    expert, input, product, mask)`` adds adapters' deltas to its gate_up (0) and down (1) products."""
    out = torch.zeros_like(x)
    num_experts, size = gate_up.shape[0], gate_up.shape[1] // 2
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < num_experts:
            raise IndexError(f"fused_moe: expert {expert} is not one of {num_experts}")
        slot, token = torch.where(ids.t() == expert)  # transformers' row order: by slot, then token
        mask = None if deltas is None else deltas.mask(token)
        products = F.linear(x[token], gate_up[expert])
        if mask is not None:
            deltas.add(0, expert, x[token], products, mask)
        if gate_up_bias is not None:
            products = products + gate_up_bias[expert]
        hidden = gated(products, size, activation)
        h = F.linear(hidden, down[expert])
        if mask is not None:
            deltas.add(1, expert, hidden, h, mask)
        if down_bias is not None:
            h = h + down_bias[expert]
        h = h * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out
