"""Triton multi-head latent attention (DeepSeek-V2/V3) over the latent paged cache, absorbed queries.

The contract is ``kernels/reference.py``'s ``mla_attention``: query [T, heads, L + R] (q_nope
through W_UK, then the rotated q_pe), one cached latent row per token [blocks, block_size, 1, L + R],
a score over all L + R dims, the value the row's first L dims, the output [T, heads, L].

Why not the shared paged-attention kernel: it holds every query head of a KV head in one tile,
and MLA has one "KV head" for all heads (128 in DeepSeek-V3) of width 576, padded to 1024: a
[128, 1024] float32 accumulator per program. Here a program takes one query token and BLOCK_H
heads, and its key loop reads each latent row once for both the score (the L part and the R part
as two dots) and the value (the L part only), with an online softmax in base 2. Grid: (tokens,
head blocks); a token finds its request by binary search over ``query_start_loc``, and its
position is the last of its request's positions minus its distance from the request's end.

Prompt tokens each read their keys again (one program per token): decodes, the case MLA's cache
is for, read each key once per head block. A prompt-tiled launch is not written; nor has this
kernel run on a GPU (no device was lent to the session that wrote it): it is checked under
TRITON_INTERPRET=1 against the reference (tests/unit/test_kernels_mla.py).

NaN safety as in paged_attention.py: keys past a query's position load as 0 and their scores are
replaced with -inf by ``tl.where``, so stale slots of a block never reach the output.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# The interpreter multiplies bf16 dot operands as raw bits (paged_attention.py): widen them there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_H = 16  # query heads per program (tl.dot's smallest M)
BLOCK_N = 32  # keys per step


@triton.jit(do_not_specialize=["num_requests"])
def _mla_attention_kernel(
    out_ptr, query_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, scale_log2, num_requests,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride,
    cache_block_stride, cache_slot_stride, block_table_stride, block_size, num_heads,
    LATENT: tl.constexpr, ROPE: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0)
    low: tl.int32 = 0
    high: tl.int32 = num_requests
    while low < high:  # the last request starting at or before this token
        mid = (low + high) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            low = mid + 1
        else:
            high = mid
    request = low - 1
    seq_len = tl.load(seq_lens_ptr + request)
    position = seq_len - (tl.load(query_start_loc_ptr + request + 1) - token)

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    lat = tl.arange(0, LATENT_PAD)
    lat_ok = lat < LATENT
    rot = tl.arange(0, ROPE_PAD)
    rot_ok = rot < ROPE
    q_row = query_ptr + token.to(tl.int64) * query_token_stride + heads[:, None] * query_head_stride
    q_latent = tl.load(q_row + lat[None, :], mask=head_ok[:, None] & lat_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + LATENT + rot[None, :], mask=head_ok[:, None] & rot_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q_latent, q_rope = q_latent.to(tl.float32), q_rope.to(tl.float32)

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    table = block_tables_ptr + request.to(tl.int64) * block_table_stride
    for start in range(0, position + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        visible = keys <= position
        block = tl.load(table + keys // block_size, mask=visible, other=0).to(tl.int64)
        rows = cache_ptr + block * cache_block_stride + (keys % block_size).to(tl.int64) * cache_slot_stride
        latent = tl.load(rows[:, None] + lat[None, :], mask=visible[:, None] & lat_ok[None, :], other=0.0)
        k_rope = tl.load(rows[:, None] + LATENT + rot[None, :], mask=visible[:, None] & rot_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            latent, k_rope = latent.to(tl.float32), k_rope.to(tl.float32)
        scores = tl.dot(q_latent, tl.trans(latent)) + tl.dot(q_rope, tl.trans(k_rope))
        scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        alpha = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(latent.dtype), latent)
        row_max = new_max
    row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)  # a padded request (seq_len 0) reads nothing
    out = acc / row_sum[:, None]
    out_row = out_ptr + token.to(tl.int64) * out_token_stride + heads[:, None] * out_head_stride
    tl.store(out_row + lat[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & lat_ok[None, :])


def mla_attention(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """The reference's contract (kernels/reference.py ``mla_attention``)."""
    num_tokens, num_heads, width = query.shape
    if latent_cache.shape[2] != 1 or latent_cache.shape[3] != width or latent_cache.stride(3) != 1:
        raise ValueError(f"mla_attention: a latent cache [blocks, block_size, 1, {width}] with contiguous rows, "
                         f"got {tuple(latent_cache.shape)}")
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty(num_tokens, num_heads, latent_dim, dtype=query.dtype, device=query.device)
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    device = query.device
    block_tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    query_start_loc = query_start_loc.to(device=device, dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    rope = width - latent_dim
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_H))
    _mla_attention_kernel[grid](
        out, query, latent_cache, block_tables, query_start_loc, seq_lens, scale * math.log2(math.e), num_requests,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), latent_cache.shape[1], num_heads,
        LATENT=latent_dim, ROPE=rope, LATENT_PAD=max(triton.next_power_of_2(latent_dim), 16),
        ROPE_PAD=max(triton.next_power_of_2(rope), 16), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        DOT_IN_FP32=_INTERPRETED and latent_cache.dtype == torch.bfloat16,
    )
    return out
