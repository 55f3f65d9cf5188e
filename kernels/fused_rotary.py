"""Triton rotary embedding: every head of one token rotated by one program.

The torch path gathers cos and sin by position and runs four products and two sums over
half-rows, six launches per layer besides the gathers. Here one program reads the token's
table row once and rotates all of its q and k heads, rounding each product and sum to the
model's dtype where transformers' half-precision ops do. That keeps it within a rounding step
of them, not bit for bit: on an H200 some bfloat16 elements differed by one step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr, out_ptr,
    heads, half, x_token_stride, x_head_stride, table_stride,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    rows = tl.arange(0, HEADS_PAD)[:, None]
    inside = (rows < heads) & (cols < half)
    cos = tl.load(cos_ptr + position * table_stride + cols, mask=cols < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * table_stride + cols, mask=cols < half, other=0.0).to(tl.float32)
    x_at = x_ptr + token * x_token_stride + rows * x_head_stride + cols
    x1 = tl.load(x_at, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + half, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    first = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    second = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out_at = out_ptr + token * heads * 2 * half + rows * 2 * half + cols
    tl.store(out_at, first.to(dtype), mask=inside)
    tl.store(out_at + half, second.to(dtype), mask=inside)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] (rows may be strided, dim contiguous), cos/sin [positions, dim // 2],
    positions [T] (already checked against the table). Returns a new contiguous tensor."""
    num_tokens, heads, dim = x.shape
    half = dim // 2
    if x.stride(2) != 1 or cos.stride() != sin.stride() or cos.stride(1) != 1 or cos.shape[1] != half:
        raise ValueError(f"rotary needs a contiguous head_dim and tables of [positions, {half}]")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _rotary_kernel[(num_tokens,)](
        x, positions, cos, sin, out,
        heads, half, x.stride(0), x.stride(1), cos.stride(0),
        HEADS_PAD=triton.next_power_of_2(heads), HALF_PAD=triton.next_power_of_2(half),
    )
    return out
