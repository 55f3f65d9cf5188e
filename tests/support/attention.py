"""Inputs and float64 answers for the attention tests: a NaN-filled paged cache holding only
the requests' own rows, fused-projection q/k/v views, and causal softmax attention per chunk."""

from __future__ import annotations

import torch

BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 4, 8, 64


def nan_cache_with_requests(seq_lens, kv_heads, generator, block_size=BLOCK_SIZE, head_dim=HEAD_DIM,
                            num_blocks=NUM_BLOCKS):
    """Caches full of NaN except the slots each request owns, its blocks scattered; block
    tables padded with block 0."""
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    permutation = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    tables = []
    for seq_len in seq_lens:
        blocks = [permutation.pop() for _ in range(-(-seq_len // block_size))]
        for b, block in enumerate(blocks):
            filled = min(block_size, seq_len - b * block_size)
            k_cache[block, :filled] = torch.randn(filled, kv_heads, head_dim, generator=generator)
            v_cache[block, :filled] = torch.randn(filled, kv_heads, head_dim, generator=generator)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def causal_attention_f64(query, key, value, first, length, scale, key_first=None, context=None):
    """Plain softmax attention per chunk, in float64; rows outside the chunks stay NaN."""
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    group = query.shape[1] // key.shape[1]
    key_first = first if key_first is None else key_first
    context = [0] * len(first) if context is None else context
    for f, kf, p, n in zip(first, key_first, context, length):
        q = query[f:f + n].double().transpose(0, 1)
        k = key[kf:kf + p + n].double().repeat_interleave(group, 1).transpose(0, 1)
        v = value[kf:kf + p + n].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale
        scores.masked_fill_(~torch.ones(n, p + n, dtype=torch.bool).tril(p), float("-inf"))
        out[f:f + n] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def qkv_rows(total, q_heads, kv_heads, head_dim, generator):
    """query, key, value as strided views of one fused projection, as the layer makes them."""
    qkv = torch.randn(total, (q_heads + 2 * kv_heads) * head_dim, generator=generator)
    q = qkv[:, :q_heads * head_dim].view(total, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(total, kv_heads, head_dim)
    return q, k, v
