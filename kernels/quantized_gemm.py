"""Triton W4A16 / W8A16: x [M, K] (bfloat16, float16 or float32) @ an integer weight [N, K], dequantized in
registers tile by tile, never as a float copy in memory: a GPU's decode reads the weight's bytes once.

The weight as the checkpoint means it (compressed-tensors, GPTQ, AWQ, all read to signed values by
worker_proc/quantization.py): W = (q - zero) * scale, a scale (and a zero point, if asymmetric) per output
channel and group of ``group`` inputs (per channel: group = K). Layouts (``pack_int4`` / as is):
- 8 bits: q int8 [N, K];
- 4 bits: q + 8 in nibbles, [N, ceil(K / 2)] uint8, input 2j in byte j's low nibble and 2j + 1 in its high one;
- scale [N, groups] float32, zero [N, groups] float32 or absent.
Each program multiplies a BLOCK_M x BLOCK_N tile over K in steps of BLOCK_K (a divisor of the group, so a
step reads one group's scales): the weight tile widened, (q - zero) * scale in float32, rounded to x's dtype
as the dequantized weight of a half-precision model is, then tl.dot into a float32 accumulator. One kernel
serves decode (M = 1: BLOCK_M 16, tl.dot's least) and prefill.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

# The Triton 3.9 interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits (see
# paged_attention.py): under it the dots run in float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32  # not yet tuned on a GPU (no GPU has been lent since this was written)


@triton.jit
def _int_weight_gemm_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
                            stride_om, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                            DOT_IN_FP32: tl.constexpr, ROUND_BF16_BY_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid, col_valid = rows < M, cols < N
    dot_dtype = tl.float32 if DOT_IN_FP32 else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)
        if BITS == 8:
            q = tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :], mask=col_valid[:, None] & k_valid[None, :],
                        other=0).to(tl.float32)
        else:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q_ptr + cols[:, None] * stride_qn + pairs[None, :],
                             mask=col_valid[:, None] & (pairs[None, :] * 2 < K), other=0x88).to(tl.int32)
            q = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32) - 8.0
        group = k0 // GROUP
        scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_valid, other=0.0)
        if HAS_ZERO:
            q = q - tl.load(zero_ptr + cols * stride_sn + group, mask=col_valid, other=0.0)[:, None]
        w = q * scale[:, None]
        if ROUND_BF16_BY_BITS:  # the interpreter's float32 -> bfloat16 cast truncates: round to nearest even here
            bits = w.to(tl.int32, bitcast=True)
            w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            w = w.to(x_ptr.dtype.element_ty)
        acc += tl.dot(x.to(dot_dtype), tl.trans(w.to(dot_dtype)), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values [N, K] (int8, -8..7) -> [N, ceil(K / 2)] uint8 of q + 8, input 2j low, 2j + 1 high."""
    n, k = q.shape
    padded = torch.full((n, k + k % 2), 8, dtype=torch.int16, device=q.device)  # an odd K's last nibble: 0
    padded[:, :k] += q.to(torch.int16)
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).to(torch.uint8).contiguous()


def block_k_for(group: int) -> int:
    """The K step for a group: BLOCK_K where it divides the group (every compressed-tensors, GPTQ and AWQ
    group of 32 and up), else one too large to be used (int_weight_gemm refuses the shape)."""
    return BLOCK_K if group % BLOCK_K == 0 else 0


def int_weight_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                    group: int, bits: int) -> torch.Tensor:
    """x [M, K] @ ((q - zero) * scale).T in the module's layouts: [M, N] in x's dtype (contiguous)."""
    m, k = x.shape
    n = q.shape[0]
    groups = -(-k // group)
    if (bits not in (4, 8) or x.stride(1) != 1 or not q.is_contiguous() or scale.shape != (n, groups)
            or q.shape[1] != (k if bits == 8 else -(-k // 2)) or (zero is not None and zero.shape != scale.shape)
            or not (group == k or block_k_for(group))):
        raise ValueError("int_weight_gemm: x, the packed weight, its scales and group do not match")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    scale = scale.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int_weight_gemm_kernel[grid](x, q, scale, scale if zero is None else zero.contiguous(), out, m, n, k, x.stride(0),
                                  q.stride(0), scale.stride(0), out.stride(0), GROUP=group, BITS=bits,
                                  HAS_ZERO=zero is not None, DOT_IN_FP32=_INTERPRETED or x.dtype == torch.float32,
                                  ROUND_BF16_BY_BITS=_INTERPRETED and x.dtype == torch.bfloat16,
                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
