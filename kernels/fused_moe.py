"""Triton mixture of experts: token blocks sorted by expert, one grouped GEMM launch per projection.

The shape of vLLM's ``fused_moe``. ``moe_align_block_size`` lays the step's (token, slot) pairs out
by expert, each expert's run padded to a whole number of BLOCK_M rows, and names each block's
expert; ``_grouped_gemm_kernel`` then multiplies every block by its expert's weight in one launch
(grid: blocks x column tiles), reading the input rows through the sorted ids and writing each pair's
row of the output. An expert no token routes to owns no block and costs nothing.

Three launches a layer: gate_up for every pair (input row = pair // top_k), the SiLU gate
(kernels/fused_silu_mul.py, which rounds the SiLU to the model's dtype as transformers does), and
down with each pair's routing weight applied to the float32 accumulator; the top_k rows of a token
are then summed. gpt-oss's experts add a bias per expert to both products (HAS_BIAS: into the
float32 accumulator, before the routing weight) and take the clamped SwiGLU in place of SiLU.

The layout is computed with torch ops on the device, sized for the worst case (pairs + experts *
(BLOCK_M - 1) rows) so nothing is read back to the host: a CUDA graph can capture it. Padding rows
carry the id ``pairs`` (masked out); blocks past the used ones return at once.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fused_silu_mul import clamped_swiglu, silu_mul
from pagedserve.kernels.moe_reference import ClampedSwiglu

# The Triton 3.9 interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits (see
# paged_attention.py): under it the dots run in float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # rows of a block: tl.dot's minimum, and a decode's few pairs an expert waste little
BLOCK_N, BLOCK_K = 64, 32  # not yet tuned on a GPU


def moe_align_block_size(ids: torch.Tensor, num_experts: int,
                         block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, top_k] -> (sorted_pair_ids [P_max] int32, block_experts [P_max / block_m] int32,
    num_rows_used [1] int32). Pair p = t * top_k + slot; each expert's pairs are contiguous in
    ascending order, padded with the id T * top_k to a multiple of block_m; a block past
    ``num_rows_used`` names expert -1."""
    pairs = ids.numel()
    flat = ids.reshape(-1).to(torch.int64)
    max_rows = pairs + num_experts * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # not bincount: on CUDA it reads its input's max back to the host, which a graph cannot capture
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=ids.device) - starts[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_pair_ids = torch.full((max_rows,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pair_ids, block_experts, padded_end[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, bias_ptr, sorted_pair_ids_ptr, block_experts_ptr,
                         num_rows_used_ptr, N, K, num_pairs, a_row_div, stride_am, stride_be, stride_bn,
                         stride_cm, stride_bias_e, MUL_ROUTED_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """C[pair, n] = (A[pair // a_row_div, :] . B[expert of the pair's block, n, :] (+ bias[expert, n]))
    (x weights[pair])."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_rows_used_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + rows).to(tl.int64)
    pair_valid = pair < num_pairs
    a_row = pair // a_row_div
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    dot_dtype = tl.float32 if DOT_IN_FP32 else b_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :], mask=pair_valid[:, None] & k_valid[None, :],
                    other=0.0).to(dot_dtype)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                    mask=k_valid[:, None] & col_valid[None, :], other=0.0).to(dot_dtype)
        acc += tl.dot(a, b, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=pair_valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=pair_valid[:, None] & col_valid[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                  layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_row_div: int, mul_weight: bool,
                  bias: Optional[torch.Tensor] = None) -> None:
    sorted_pair_ids, block_experts, num_rows_used = layout
    n, k = b.shape[1], b.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](a, b, out, weights, out if bias is None else bias, sorted_pair_ids, block_experts,
                               num_rows_used, n, k, out.shape[0], a_row_div, a.stride(0), b.stride(0), b.stride(1),
                               out.stride(0), 0 if bias is None else bias.stride(0), MUL_ROUTED_WEIGHT=mul_weight,
                               HAS_BIAS=bias is not None, DOT_IN_FP32=_INTERPRETED or b.dtype == torch.float32,
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, gate_up_bias: Optional[torch.Tensor] = None,
              down_bias: Optional[torch.Tensor] = None, activation: Optional[ClampedSwiglu] = None) -> torch.Tensor:
    """moe_reference.fused_moe's contract: x [T, H], gate_up [E, 2I, H], down [E, H, I] (contiguous),
    routing weights / ids [T, top_k] -> [T, H] in x's dtype; biases [E, 2I] / [E, H] (contiguous rows)
    and the activation as the reference takes them."""
    tokens, top_k = ids.shape
    num_experts, size = gate_up.shape[0], gate_up.shape[1] // 2
    if x.stride(1) != 1 or not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("fused_moe: x's rows and the expert weights must be contiguous")
    if tokens == 0:
        return torch.zeros((0, x.shape[1]), dtype=x.dtype, device=x.device)
    layout = moe_align_block_size(ids, num_experts)
    flat_weights = weights.reshape(-1).contiguous()
    # Every pair's row is written (each pair sits in exactly one block), so empty() is safe.
    gate_up_rows = torch.empty((tokens * top_k, 2 * size), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, gate_up_rows, flat_weights, layout, top_k, mul_weight=False, bias=gate_up_bias)
    hidden = (silu_mul(gate_up_rows, size) if activation is None
              else clamped_swiglu(gate_up_rows, size, activation.alpha, activation.limit))
    down_rows = torch.empty((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden, down, down_rows, flat_weights, layout, 1, mul_weight=True, bias=down_bias)
    return down_rows.view(tokens, top_k, -1).sum(dim=1, dtype=x.dtype)
