"""kernels/cpu_moe.c against kernels/moe_reference.py's ``fused_moe`` (transformers' experts loop, op for op),
for the unit test (this CPU's build) and the e2e test (each x86-64 level's build).

The kernel rounds where the reference rounds (each product, its bias, the activation's ops, the weighting,
each add into a token's row); only its dot products sum in another order, in float32. So nearly every output
is the reference's bits, and the rest lie within a few bfloat16 steps of it."""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.kernels import moe_reference
from pagedserve.kernels.cpu_moe import NativeExperts
from pagedserve.kernels.moe_routing import RoutingRule, route


def randn(*shape, seed: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).bfloat16()


def routing(tokens: int, num_experts: int, top_k: int, seed: int, unused: tuple[int, ...] = ()):
    """Routing weights and ids [tokens, top_k] by transformers' rule over random logits; never ``unused``."""
    logits = randn(tokens, num_experts, seed=seed).float()
    logits[:, list(unused)] = -1e4
    return route(logits.bfloat16(), RoutingRule(top_k, renormalize=True))


def experts(num_experts: int, hidden: int, size: int, seed: int, gpt_oss: bool = False):
    """gate_up [E, 2I, H], down [E, H, I], and with ``gpt_oss`` its biases and clamped SwiGLU (a limit the
    random products reach), else None for each."""
    gate_up = randn(num_experts, 2 * size, hidden, seed=seed, std=0.2)
    down = randn(num_experts, hidden, size, seed=seed + 1, std=0.2)
    if not gpt_oss:
        return gate_up, down, None, None, None
    return (gate_up, down, randn(num_experts, 2 * size, seed=seed + 2, std=0.5),
            randn(num_experts, hidden, seed=seed + 3, std=0.5), moe_reference.ClampedSwiglu(alpha=1.702, limit=0.5))


def native(gate_up, down, gate_up_bias=None, down_bias=None, activation=None) -> NativeExperts:
    return NativeExperts(list(gate_up), list(down), None if gate_up_bias is None else list(gate_up_bias),
                         None if down_bias is None else list(down_bias), activation)


def assert_reference(got: torch.Tensor, expected: torch.Tensor, min_equal: float = 0.95) -> None:
    """got is the reference's bits but for a few outputs, each within a few bfloat16 steps."""
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    scale = expected.float().abs().max().item() or 1.0
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2 * scale)
    if got.numel():
        assert (got == expected).float().mean().item() >= min_equal


def check_native_experts(tokens: int, num_experts: int, top_k: int, hidden: int, size: int, seed: int = 0,
                         gpt_oss: bool = False, unused: tuple[int, ...] = (),
                         ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel against the reference on one random case (``ids``: this routing's ids instead); returns the
    kernel's output."""
    x = randn(tokens, hidden, seed=seed + 10)
    gate_up, down, gate_up_bias, down_bias, activation = experts(num_experts, hidden, size, seed, gpt_oss)
    weights, routed = routing(tokens, num_experts, top_k, seed + 20, unused)
    ids = routed if ids is None else ids
    got = native(gate_up, down, gate_up_bias, down_bias, activation)(x, weights, ids)
    expected = moe_reference.fused_moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation)
    assert_reference(got, expected)
    return got
