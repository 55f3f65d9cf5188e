"""Triton LoRA shrink and expand for tokens of several adapters in one batch, in the two shapes of
Punica: BGMV (one slot index per token: decodes, each program one token's product with its slot's
weights) and SGMV (tokens sorted into one segment per slot: prefill, each program a tile of a
segment's rows through ``tl.dot``).

    shrink: s[t] = a[slot(t)] @ x[t]          x [T, K], a [slots, N, K], s [T, N] float32
    expand: y[t] += s[t, :R] @ b[slot(t)]     s [T, >= R] float32, b [slots, R, O], y [T, O] (strided rows)

A token of slot -1 (the base model) is left as it is. Sums are float32; ``y`` is rounded once. The
references (kernels/reference.py) compute the same with torch, per slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_bgmv(x_ptr, a_ptr, slots_ptr, s_ptr, K, N, stride_xt, stride_al, stride_an, stride_st,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    n_lim = tl.where(slot >= 0, N, 0)  # a base-model token (-1): nothing read, nothing written
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = tl.load(a_ptr + slot * stride_al + offs_n[:, None] * stride_an + offs_k[None, :],
                    mask=(offs_n[:, None] < n_lim) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(s_ptr + t * stride_st + offs_n, acc, mask=offs_n < n_lim)


@triton.jit
def _expand_bgmv(s_ptr, b_ptr, slots_ptr, y_ptr, R, O, stride_st, stride_bl, stride_br, stride_yt,
                 BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    t = tl.program_id(0)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    o_lim = tl.where(slot >= 0, O, 0)  # a base-model token (-1): nothing read, nothing written
    s = tl.load(s_ptr + t * stride_st + offs_r, mask=offs_r < R, other=0.0)
    w = tl.load(b_ptr + slot * stride_bl + offs_r[:, None] * stride_br + offs_o[None, :],
                mask=(offs_r[:, None] < R) & (offs_o[None, :] < o_lim), other=0.0).to(tl.float32)
    delta = tl.sum(w * s[:, None], axis=0)
    y_at = y_ptr + t * stride_yt + offs_o
    out_mask = offs_o < o_lim
    y = tl.load(y_at, mask=out_mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + delta).to(y.dtype), mask=out_mask)


@triton.jit
def _segment_tile(starts_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """This program's segment: its rows' end, slot, and the tile of its rows (axis 1 of the grid)."""
    seg = tl.program_id(0)
    start, end = tl.load(starts_ptr + seg), tl.load(starts_ptr + seg + 1)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return end, tl.load(slots_ptr + seg).to(tl.int64), rows


@triton.jit
def _shrink_sgmv(x_ptr, a_ptr, starts_ptr, slots_ptr, s_ptr, K, N, stride_xt, stride_al, stride_an, stride_st,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    end, slot, rows = _segment_tile(starts_ptr, slots_ptr, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                    mask=(rows[:, None] < end) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(a_ptr + slot * stride_al + offs_n[None, :] * stride_an + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0).to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(s_ptr + rows[:, None].to(tl.int64) * stride_st + offs_n[None, :], acc,
             mask=(rows[:, None] < end) & (offs_n[None, :] < N))


@triton.jit
def _expand_sgmv(s_ptr, b_ptr, starts_ptr, slots_ptr, y_ptr, R, O, stride_st, stride_bl, stride_br, stride_yt,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    end, slot, rows = _segment_tile(starts_ptr, slots_ptr, BLOCK_M)
    offs_o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_r = tl.arange(0, BLOCK_R)
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_st + offs_r[None, :],
                mask=(rows[:, None] < end) & (offs_r[None, :] < R), other=0.0)
    w = tl.load(b_ptr + slot * stride_bl + offs_r[:, None] * stride_br + offs_o[None, :],
                mask=(offs_r[:, None] < R) & (offs_o[None, :] < O), other=0.0).to(tl.float32)
    delta = tl.dot(s, w, input_precision="ieee")
    y_at = y_ptr + rows[:, None].to(tl.int64) * stride_yt + offs_o[None, :]
    out_mask = (rows[:, None] < end) & (offs_o[None, :] < O)
    y = tl.load(y_at, mask=out_mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + delta).to(y.dtype), mask=out_mask)


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    if x.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("lora kernels: the last dimension of every operand must be contiguous")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, s: torch.Tensor) -> None:
    """BGMV shrink: s[t] = a[token_slots[t]] @ x[t] for each token with a slot (s float32)."""
    _check(x, a, s)
    tokens, k = x.shape
    n = a.shape[1]
    block_n = 16
    grid = (tokens, triton.cdiv(n, block_n))
    _shrink_bgmv[grid](x, a, token_slots, s, k, n, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                       BLOCK_N=block_n, BLOCK_K=128)


def lora_expand(s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """BGMV expand: y[t] += s[t, :R] @ b[token_slots[t]] in place for each token with a slot."""
    _check(s, b, y)
    tokens, out = y.shape
    rank = b.shape[1]
    block_o = 128
    grid = (tokens, triton.cdiv(out, block_o))
    _expand_bgmv[grid](s, b, token_slots, y, rank, out, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                       BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_O=block_o)


def lora_shrink_segments(x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                         s: torch.Tensor, max_segment: int) -> None:
    """SGMV shrink over rows sorted by slot: rows [seg_starts[i], seg_starts[i + 1]) take slot seg_slots[i];
    ``max_segment``: the longest segment's rows (sizes the grid)."""
    _check(x, a, s)
    k, n = x.shape[1], a.shape[1]
    block_m, block_n = 16, 32
    grid = (seg_slots.shape[0], triton.cdiv(max_segment, block_m), triton.cdiv(n, block_n))
    _shrink_sgmv[grid](x, a, seg_starts, seg_slots, s, k, n, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64)


def lora_expand_segments(s: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                         y: torch.Tensor, max_segment: int) -> None:
    """SGMV expand over rows sorted by slot (as lora_shrink_segments): y[rows] += s[rows, :R] @ b[slot]."""
    _check(s, b, y)
    out, rank = y.shape[1], b.shape[1]
    block_m, block_o = 16, 64
    grid = (seg_slots.shape[0], triton.cdiv(max_segment, block_m), triton.cdiv(out, block_o))
    _expand_sgmv[grid](s, b, seg_starts, seg_slots, y, rank, out, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                       BLOCK_M=block_m, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_O=block_o)
