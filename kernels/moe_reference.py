"""Plain-torch mixture of experts after routing: the oracle of the CPU grouped path and the Triton fused_moe.

Each active expert, in ascending order, runs its SwiGLU MLP over the tokens routed to it, and its
output, scaled by the routing weight, is added into the token's row: transformers' experts loop
(``MixtralExperts.forward``, ``Qwen2MoeExperts.forward``), op for op, so a token's experts are
summed in the same order and float32 results are transformers' bit for bit.

Weights are transformers' fused 3D layout: ``gate_up`` [E, 2 * I, H] (gate rows first, then up)
and ``down`` [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], routing ``weights`` / ``ids`` [T, top_k] (moe_routing.route) -> [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    num_experts, size = gate_up.shape[0], gate_up.shape[1] // 2
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < num_experts:
            raise IndexError(f"fused_moe: expert {expert} is not one of {num_experts}")
        slot, token = torch.where(ids.t() == expert)  # transformers' row order: by slot, then token
        gate, up = F.linear(x[token], gate_up[expert]).split(size, dim=-1)
        h = F.linear(F.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out
