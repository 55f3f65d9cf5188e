"""Triton SiLU gate: silu(gate) * up from the fused gate_up projection, in one pass; and gpt-oss's
clamped SwiGLU (kernels/moe_reference.py ``ClampedSwiglu``) the same way.

The torch path is a split, a SiLU and a product, two launches and an intermediate the size
of the MLP. The SiLU is rounded to the model's dtype before the product, as in transformers; the
clamped SwiGLU rounds where transformers' ops round (alpha * gate, its sigmoid, the gate's product,
up + 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, in_stride, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < size
    gate = tl.load(gate_up_ptr + token * in_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * in_stride + size + cols, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * size + cols, (silu * up).to(dtype), mask=inside)


def _gated(kernel, name: str, gate_up: torch.Tensor, size: int, *args) -> torch.Tensor:
    """``kernel`` over gate_up [T, 2 * size] (gate first, rows contiguous) into [T, size]: one program per
    token and block of columns; ``args`` after the row stride."""
    num_tokens = gate_up.shape[0]
    if gate_up.shape[1] != 2 * size or gate_up.stride(1) != 1:
        raise ValueError(f"{name} needs [T, {2 * size}] with contiguous rows, got {tuple(gate_up.shape)}")
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(size))
    kernel[(num_tokens, triton.cdiv(size, block))](gate_up, out, size, gate_up.stride(0), *args, BLOCK=block)
    return out


def silu_mul(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    """gate_up [T, 2 * size] (gate first, rows contiguous) -> silu(gate) * up, [T, size]."""
    return _gated(_silu_mul_kernel, "silu_mul", gate_up, size)


@triton.jit
def _clamped_swiglu_kernel(gate_up_ptr, out_ptr, size, in_stride, alpha, limit, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < size
    gate = tl.load(gate_up_ptr + token * in_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * in_stride + size + cols, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    scaled = (gate * alpha).to(dtype).to(tl.float32)
    sigmoid = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    glu = (gate * sigmoid).to(dtype).to(tl.float32)
    up_plus_one = (up + 1.0).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * size + cols, (up_plus_one * glu).to(dtype), mask=inside)


def clamped_swiglu(gate_up: torch.Tensor, size: int, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [T, 2 * size] (gate first, rows contiguous) -> gpt-oss's clamped SwiGLU, [T, size]."""
    return _gated(_clamped_swiglu_kernel, "clamped_swiglu", gate_up, size, alpha, limit)
