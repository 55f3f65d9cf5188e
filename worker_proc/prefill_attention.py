"""Attention of one prefill chunk (more than one query) through scaled_dot_product_attention (CPU).

kernels.reference.paged_attention gathers the chunk's context from the cache and expands
K/V per query head (repeat_interleave) before two matmuls; on CPU one fused SDPA call per
chunk is several times faster. A chunk whose context is exactly its own tokens (a
prompt's first chunk, no cached prefix) attends over this step's K/V directly, causally,
without reading the cache at all; a chunk after a cached prefix gathers only the slots
it may attend (positions below its own end, inside the sliding window), so stale data in
unused slots is never read. K/V are written to the cache by the caller either way.

Attention sinks (gpt-oss) go through SDPA as one more key: zeros, so it adds no value, whose score
the additive mask sets to the head's sink (``with_sink_key``; the decode path's SDPA shares it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    start: int  # rows start:end of the step's ragged batch are this chunk's queries
    end: int
    seq_len: int  # cached context + this chunk's tokens
    context_slots: Optional[torch.Tensor]  # [seq_len] long flat cache slots; None without cached context


def plan_prefill_chunk(start: int, end: int, seq_len: int, block_table: torch.Tensor, block_size: int) -> PrefillChunk:
    if end - start == seq_len:
        return PrefillChunk(start, end, seq_len, None)
    positions = torch.arange(seq_len)
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    return PrefillChunk(start, end, seq_len, slots)


def _visibility(q_len: int, seq_len: int, first_key: int, sliding_window: Optional[int]) -> torch.Tensor:
    """[q_len, seq_len - first_key] bool: query i (position seq_len - q_len + i) sees key p."""
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(first_key, seq_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None and sliding_window > 0:
        visible &= (q_pos - k_pos) < sliding_window
    return visible


def with_sink_key(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                  sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's keys and values [..., S, dim] with one more row of zeros, and its additive mask
    ``bias`` [..., L, S] with one more column holding ``sinks`` ([..., 1], one per query head,
    broadcast against the mask): the softmax gives the sink its share, and the zero row adds no
    value, as the sink's definition asks."""
    zeros = keys.new_zeros((*keys.shape[:-2], 1, keys.shape[-1]))
    rows = torch.broadcast_shapes(bias.shape[:-1], sinks.shape[:-1])
    bias = torch.cat([bias.expand(*rows, bias.shape[-1]), sinks.float().expand(*rows, 1)], dim=-1)
    return torch.cat([keys, zeros], dim=-2), torch.cat([values, zeros], dim=-2), bias


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      sliding_window: Optional[int], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query [q_len, q_heads, dim] and this chunk's own key/value [q_len, kv_heads, dim];
    returns [q_len, q_heads, dim], as kernels.reference.paged_attention (float32 inside).
    ``sinks`` [q_heads]: the layer's attention sinks, or None."""
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    windowed = sliding_window is not None and 0 < sliding_window < chunk.seq_len
    mask = None
    if chunk.context_slots is None:
        keys, values = key.to(k_cache.dtype), value.to(v_cache.dtype)  # what the cache holds
        if windowed:
            mask = _visibility(q_len, chunk.seq_len, 0, sliding_window)
    else:
        first = max(0, chunk.seq_len - q_len - sliding_window + 1) if windowed else 0
        slots = chunk.context_slots[first:]
        keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        mask = _visibility(q_len, chunk.seq_len, first, sliding_window)
    keys, values = keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None]
    if sinks is not None:
        first_key = chunk.seq_len - keys.shape[2]
        visible = mask if mask is not None else _visibility(q_len, chunk.seq_len, first_key, None)
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        keys, values, mask = with_sink_key(keys, values, bias, sinks.reshape(1, -1, 1, 1))
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=num_q_heads != num_kv_heads)
    return out[0].transpose(0, 1).to(query.dtype)
