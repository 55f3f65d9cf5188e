"""A batched fast path for steps where every request decodes exactly one token (CPU).

kernels.reference.paged_attention loops over requests in Python; for a pure-decode
batch the same result comes from one gather of every request's blocks into a padded
[B, max_len] view and one masked batched softmax. The visibility mask depends only on
the step's sequence lengths, so it is built once per step and shared by all layers.
Slots past a request's length may hold stale data (even NaN): scores there are replaced
with -inf and V rows with 0 by ``where`` (never multiplied), so nothing leaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(slots=True)
class DecodeMask:
    visible: torch.Tensor  # [B, max_len] bool: key slot j of request b is attended
    visible_scores: torch.Tensor  # visible reshaped to broadcast over [B, kv_heads, group, max_len]
    visible_values: torch.Tensor  # visible reshaped to broadcast over [B, max_len, kv_heads, dim]


def build_decode_mask(
    seq_lens: torch.Tensor, max_len: int, sliding_window: Optional[int]
) -> DecodeMask:
    """The query of request b sits at position seq_lens[b] - 1."""
    key_pos = torch.arange(max_len, device=seq_lens.device)[None, :]
    last = (seq_lens.long() - 1)[:, None]
    visible = key_pos <= last
    if sliding_window is not None and sliding_window > 0:
        visible &= (last - key_pos) < sliding_window
    return DecodeMask(visible, visible[:, None, None, :], visible[:, :, None, None])


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    mask: DecodeMask,
) -> torch.Tensor:
    """query: [B, q_heads, dim], one token per request; block_tables: [B, max_blocks].

    Same contract as kernels.reference.paged_attention restricted to one query per request.
    """
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_len = mask.visible.shape[1]
    blocks = block_tables.long()
    keys = k_cache[blocks].view(batch, -1, num_kv_heads, head_dim)[:, :max_len]
    values = v_cache[blocks].view(batch, -1, num_kv_heads, head_dim)[:, :max_len]
    values = torch.where(mask.visible_values, values, 0.0)
    q = query.float().view(batch, num_kv_heads, group, head_dim)
    # [B, kv, group, dim] x [B, kv, dim, len] -> [B, kv, group, len]
    scores = torch.matmul(q, keys.float().permute(0, 2, 3, 1)) * scale
    scores = torch.where(mask.visible_scores, scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.float().transpose(1, 2))  # [B, kv, group, dim]
    return out.reshape(batch, num_q_heads, head_dim).to(query.dtype)
