"""Triton paged attention: one launch for a ragged batch mixing decodes and (chunked) prefills.

Grid: (query tile, kv head). A request's query tokens are cut into tiles of BLOCK_Q tokens;
request b owns the tiles starting at ``query_start_loc[b] // BLOCK_Q + b`` (found by binary
search in the kernel), so the grid size ``num_tokens // BLOCK_Q + num_requests`` is known
on the host without reading any per-request length back from the device. One program
handles every query head of its kv head (GQA), so each K/V tile is loaded once per group.

Short and long requests are launched apart. A decode's tile holds one token's GROUP_PAD heads,
padded to the 16 rows tl.dot needs; a prompt's tile of that size re-reads its keys every 16
rows. So requests of up to BLOCK_Q tokens (decodes, speculative verifies) run in a launch of
16-row tiles and 64-key steps, and longer ones in a second launch of 128-row tiles (64 in
float32); each launch's programs return at once for the other kind. A step of decodes only
(num_tokens == num_requests, as every CUDA-graph replay) makes only the first launch. Tile
shapes: bench/scripts/attention_sweep.py, bench/log/2026-11-28.md "GPU: paged attention's tiles".

In a step of decodes only, each request's keys can be cut into ``decode_splits`` parts, one
program each, whose outputs a second kernel weighs by their softmax sums (flash-decoding): off
until a GPU session times it (DECODE_SPLITS).

Attention sinks (gpt-oss; ``sinks`` [q_heads], SINKS): each row's running max and sum start from
its head's sink, as if it were a key before the first with a value of zeros; with splits only the
first part starts from it, so the combined sum counts it once.

NaN safety: keys past ``seq_len`` are loaded as 0 (K and V), and every masked score is
replaced with -inf by ``tl.where`` before the softmax, so a stale NaN in an unused slot of
the last block never reaches the output.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

# The Triton 3.9 interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits;
# under it, bf16 dots run in fp32 instead (on a GPU they stay bf16 on the tensor cores).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MIN_ROWS_PER_TILE = 16  # tl.dot wants at least 16 rows
# (rows of queries, keys per tile, num_warps, num_stages) of each launch, by the sweep on an
# H200 (bench/log/2026-11-28.md "GPU: paged attention's tiles"). Long: by the cache's element size; float32's
# is smaller so its fp32 tiles fit, and was not timed.
SHORT_TILE = (MIN_ROWS_PER_TILE, 64, 4, 2)
LONG_TILE = {2: (128, 32, 4, 2), 4: (64, 64, 4, 2)}
SHORT, LONG = 1, 2  # which requests a launch serves: up to short_len tokens, or more
DECODE_SPLITS = 1  # parts of a decode's keys; off until timed on a GPU (bench/log/2026-11-28.md "Open on a GPU")


@triton.jit
def _request_of_tile(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """The largest request b whose first tile ``query_start_loc[b] // BLOCK_Q + b`` is <= tile."""
    # Typed loop-carried bounds: a plain 0 (or a batch of one, which triton would specialize
    # to a constant) must not change type across iterations when compiled.
    low: tl.int32 = 0
    high: tl.int32 = num_requests
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit(do_not_specialize=["num_requests"])
def _paged_attention_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2, softcap, sinks_ptr, num_requests,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride,
    block_size, head_dim, group_size,
    short_len, part_ptr, part_ml_ptr, num_tokens, num_q_heads,
    SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, SERVES: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr, DOT_IN_FP32: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _request_of_tile(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_begin
    if SERVES == 1:
        if q_len > short_len:
            return
    else:
        if q_len <= short_len:
            return
    tile_start = (tile - (q_begin // BLOCK_Q + request)) * BLOCK_Q
    if tile_start >= q_len:  # spare program: the grid is an upper bound on the tile count
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len

    # Row r of the tile is query token tile_start + r // GROUP_PAD, head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_M)
    token_in_request = tile_start + rows // GROUP_PAD
    head = kv_head * group_size + rows % GROUP_PAD
    row_valid = (token_in_request < q_len) & (rows % GROUP_PAD < group_size)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < head_dim
    token = (q_begin + token_in_request).to(tl.int64)
    q_offsets = token[:, None] * query_token_stride + head[:, None] * query_head_stride + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    # the query's dtype: a float8 cache's keys and values widen to it exactly (--kv-cache-dtype fp8)
    dot_dtype = tl.float32 if DOT_IN_FP32 else query_ptr.dtype.element_ty
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(dot_dtype)
    q_pos = context_len + token_in_request

    # Keys this tile can see: causal upper end, sliding-window lower end.
    kv_end = tl.minimum(context_len + tile_start + BLOCK_Q, seq_len)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + tile_start - SLIDING_WINDOW + 1, 0)

    if NUM_SPLITS > 1:  # this program's share of the keys, whole tiles of them
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_start + tl.program_id(2) * per_split
        kv_end = tl.minimum(kv_start + per_split, kv_end)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SINKS:  # the sink as a first key: its score (in log2 units) is the max so far, exp2(0) = 1 the sum
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        if NUM_SPLITS > 1:
            if tl.program_id(2) != 0:  # the first part alone counts it
                m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros((BLOCK_M, DIM_PAD), dtype=tl.float32)
    for kv_tile_start in range(kv_start, kv_end, BLOCK_N):
        k_pos = kv_tile_start + tl.arange(0, BLOCK_N)
        k_exists = k_pos < seq_len
        physical_block = tl.load(
            block_tables_ptr + request.to(tl.int64) * block_table_stride + k_pos // block_size,
            mask=k_exists, other=0,
        ).to(tl.int64)
        kv_offsets = physical_block * cache_block_stride + (k_pos % block_size) * cache_slot_stride
        kv_offsets = kv_offsets[:, None] + kv_head * cache_head_stride + dims[None, :]
        kv_mask = k_exists[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(dot_dtype)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        if SOFTCAP:  # c * tanh(s / c) of the scaled score s, in log2 units: scores is s * log2(e) here
            capped = scores / (softcap * 1.4426950408889634)
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp2 overflows to inf, or reaches 0)
            scores = (1.0 - 2.0 / (tl.math.exp2(capped * 2.8853900817779268) + 1.0)) * (softcap * 1.4426950408889634)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_exists[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) < SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(dot_dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS > 1:  # a part: its normalized output, max and sum, for _combine_splits_kernel
        row = (tl.program_id(2) * num_tokens + token) * num_q_heads + head
        tl.store(part_ptr + row[:, None] * DIM_PAD + dims[None, :], out, mask=q_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)
    else:
        out_offsets = token[:, None] * out_token_stride + head[:, None] * out_head_stride + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_splits_kernel(out_ptr, part_ptr, part_ml_ptr, num_tokens, num_q_heads, out_token_stride,
                           out_head_stride, head_dim, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           DIM_PAD: tl.constexpr):
    """One (token, head): the parts' outputs weighted by their share of the softmax's sum."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_PAD)
    exists = split < NUM_SPLITS
    row = (split.to(tl.int64) * num_tokens + token) * num_q_heads + head
    m = tl.load(part_ml_ptr + row * 2, mask=exists, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=exists, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(l > 0.0, tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)) * l, 0.0)
    total = tl.sum(weight, 0)
    dims = tl.arange(0, DIM_PAD)
    parts = tl.load(part_ptr + row[:, None] * DIM_PAD + dims[None, :],
                    mask=exists[:, None] & (dims[None, :] < head_dim), other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    *,
    tiles: Optional[tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = None,
    decode_splits: int = DECODE_SPLITS,
) -> torch.Tensor:
    """Causal attention of a ragged batch over its paged context (same contract as the reference).

    ``tiles`` (the short and the long launch's rows, keys, num_warps, num_stages) is the
    sweep's knob (bench/scripts/attention_sweep.py); None is what the engine runs.
    ``decode_splits`` > 1 cuts each request's keys into that many parts in a step of decodes
    only, combined by a second kernel (flash-decoding): a few decodes then use more than a
    few of the GPU's multiprocessors."""
    num_tokens, num_q_heads, _ = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads cannot be grouped over {num_kv_heads} kv heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous head_dim")
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    short_tile, long_tile = tiles or (SHORT_TILE, LONG_TILE[4 if k_cache.element_size() >= 4 else 2])
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    device = query.device
    meta = (block_tables.to(device=device, dtype=torch.int32).contiguous(),
            query_start_loc.to(device=device, dtype=torch.int32).contiguous(),
            seq_lens.to(device=device, dtype=torch.int32).contiguous())
    short_len = max(short_tile[0] // group_pad, 1)
    if sinks is not None:
        sinks = sinks.to(device=device, dtype=torch.float32).contiguous()
    launch = (out, query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks, group_pad)
    if num_tokens > num_requests:  # some request has more than one token
        _launch(*launch, SHORT, short_len, short_tile, 1)
        _launch(*launch, LONG, short_len, long_tile, 1)
    else:
        _launch(*launch, SHORT, short_len, short_tile, max(decode_splits, 1))
    return out


def _launch(out, query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks, group_pad, serves, short_len,
            tile, splits):
    rows, keys, num_warps, num_stages = tile
    block_tables, query_start_loc, seq_lens = meta
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, num_requests = k_cache.shape[2], seq_lens.shape[0]
    block_q = max(rows // group_pad, 1)
    dim_pad = max(triton.next_power_of_2(head_dim), 16)
    part = part_ml = out  # unused without splits
    if splits > 1:
        part = torch.empty(splits, num_tokens, num_q_heads, dim_pad, dtype=torch.float32, device=out.device)
        part_ml = torch.empty(splits, num_tokens, num_q_heads, 2, dtype=torch.float32, device=out.device)
    grid = (num_tokens // block_q + num_requests, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        scale * math.log2(math.e), softcap or 0.0, out if sinks is None else sinks, num_requests,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1], head_dim, num_q_heads // num_kv_heads, short_len, part, part_ml, num_tokens, num_q_heads,
        SLIDING_WINDOW=sliding_window or 0, SOFTCAP=softcap is not None, SINKS=sinks is not None, SERVES=serves,
        BLOCK_Q=block_q, GROUP_PAD=group_pad,
        BLOCK_N=keys, DIM_PAD=dim_pad, DOT_IN_FP32=_INTERPRETED and query.dtype == torch.bfloat16,
        NUM_SPLITS=splits, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out, part, part_ml, num_tokens, num_q_heads, out.stride(0), out.stride(1), head_dim,
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), DIM_PAD=dim_pad)
