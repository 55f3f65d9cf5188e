"""Triton RMSNorm, optionally after the residual add, in one pass over each row.

transformers' RMSNorm is eight elementwise and reduction kernels in half precision (to
float32, square, mean, add eps, rsqrt, scale, back, times the weight), and the residual add
before it a ninth; at decode batch sizes on a GPU each is a launch of a few microseconds
over a few kilobytes. One program per row does it all here, with the same rounding points
as transformers (the sum rounded to the model's dtype, the normalised row rounded before the
weight), so only the order of the squares' sum can differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    heads, x_token_stride, x_head_stride, residual_stride, weight_head_stride, out_stride,
    n, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x_at = x_ptr + token * x_token_stride + head * x_head_stride + cols
    x = tl.load(x_at, mask=inside, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_at, x, mask=inside)  # the sum is the next residual, in x's place
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n
    normed = (h * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + head * weight_head_stride + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=inside)


def _launch(x: torch.Tensor, residual, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("rms_norm needs rows with a contiguous last dimension")
    n = x.shape[-1]
    if x.dim() == 2:  # [T, n] with one weight row
        heads, token_stride, head_stride = 1, x.stride(0), 0
        if weight.shape != (n,):
            raise ValueError(f"weight {tuple(weight.shape)} for rows of {n}")
        weight_head_stride = 0
    elif x.dim() == 3:  # [T, heads, n]: per-head norm (Qwen3's q/k), weight [n] or [heads, n]
        heads, token_stride, head_stride = x.shape[1], x.stride(0), x.stride(1)
        if weight.shape not in ((n,), (heads, n)) or not weight.is_contiguous():
            raise ValueError(f"weight {tuple(weight.shape)} for {heads} heads of {n}")
        weight_head_stride = n if weight.dim() == 2 else 0
    else:
        raise ValueError(f"rms_norm takes [T, n] or [T, heads, n], got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or x.dim() != 2):
        raise ValueError("the residual must be [T, n] like x")
    rows = x.shape[0] * heads
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        heads, token_stride, head_stride, residual.stride(0) if residual is not None else 0,
        weight_head_stride, n,  # out is contiguous: a row is n apart
        n, eps,
        ADD_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of each row of x ([T, n], or [T, heads, n] with a per-head weight)."""
    return _launch(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual). The sum is written over x, as the torch path's
    ``x.add_(residual)`` does: x is the layer's own output, and the sum its next residual."""
    return _launch(x, residual, weight, eps), x
