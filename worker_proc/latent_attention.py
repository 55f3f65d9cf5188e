"""Multi-head latent attention over the latent paged cache (DeepSeek), decodes with absorbed up-projections.

Decodes: each head's q_nope goes through its W_UK into the latent's space, so its scores are
products with the cached latent rows themselves (c, k_rope), and the attention output in that space
goes through W_UV to the head's values (models/deepseek.py says why): multi-query attention over one
"KV head" of width L + R whose value is its first L dims. On CPU that is the native decode kernel
(or its gathered SDPA fallback) with the latent row as K and as V, the output's last R dims dropped.

Prompt chunks on CPU are expanded instead, as transformers computes them (and as vLLM prefills): the
visible latent rows, cached context and the chunk's own, become each head's key [c W_UK^T, k_rope]
and value c W_UV, then one causal SDPA call. A score is then a qk_nope + R product, not an L + R
one: 1.35-1.8x faster for one layer of DeepSeek-V3's dims at 16 heads, 1024 and 256 tokens, one
thread (noisy shared machine; bench/log/2026-12-07.md).

On Triton ops (CUDA, or PAGEDSERVE_KERNELS=triton under TRITON_INTERPRET=1) the whole step, prompts
too, is absorbed, through kernels/mla_attention.py.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels import reference
from pagedserve.worker_proc.attention import CpuAttentionPlan
from pagedserve.worker_proc.decode_attention import decode_attention
from pagedserve.worker_proc.prefill_attention import PrefillChunk, _visibility


def latent_attention(ops: ModuleType, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_rows: torch.Tensor,
                     w_uk: torch.Tensor, w_uv: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     plan: Optional[CpuAttentionPlan]) -> torch.Tensor:
    """q_nope [T, heads, nope], q_rope [T, heads, R] (rotated), this step's latent rows [T, 1, L + R]
    (already written to ``latent_cache`` [blocks, block_size, 1, L + R]); w_uk [heads, nope, L],
    w_uv [heads, L, v]. Returns each head's attention values [T, heads, v]."""
    if ops is reference and plan is not None and plan.chunks:  # CPU, prompt chunks in the step
        out = torch.empty(*q_nope.shape[:2], w_uv.shape[2], dtype=q_nope.dtype)
        if plan.decode_rows is not None:
            decodes = plan.decode_rows  # the plan's decode context knows their blocks and lengths
            out[decodes] = _absorbed(ops, q_nope[decodes], q_rope[decodes], w_uk, w_uv, latent_cache, block_tables,
                                     query_start_loc, seq_lens, scale, plan)
        for c in plan.chunks:
            own = slice(c.start, c.end)
            out[own] = expanded_chunk(q_nope[own], q_rope[own], latent_rows[own], latent_cache, c, w_uk, w_uv, scale)
        return out
    return _absorbed(ops, q_nope, q_rope, w_uk, w_uv, latent_cache, block_tables, query_start_loc, seq_lens, scale,
                     plan)


def _absorbed(ops: ModuleType, q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
              latent_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
              seq_lens: torch.Tensor, scale: float, plan: Optional[CpuAttentionPlan]) -> torch.Tensor:
    """q_nope through W_UK, attention over the latent rows, W_UV: on CPU only decodes come here (the
    plan's decode context), elsewhere the whole step."""
    latent_dim = w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    query = torch.cat([q_latent, q_rope], dim=-1)
    if ops is reference and plan is not None:
        rows = decode_attention(query, latent_cache, latent_cache, scale, plan.decode_context(None))[..., :latent_dim]
    else:
        rows = ops.mla_attention(query, latent_cache, block_tables, query_start_loc, seq_lens, scale, latent_dim)
    return torch.bmm(rows.transpose(0, 1), w_uv).transpose(0, 1)

def expanded_chunk(q_nope: torch.Tensor, q_rope: torch.Tensor, own_rows: torch.Tensor, latent_cache: torch.Tensor,
                   chunk: PrefillChunk, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt chunk as transformers computes it: every visible latent row (cached context, then the
    chunk's own) expanded into each head's key [c W_UK^T, k_rope] and value c W_UV, then causal SDPA,
    float32 inside. q_nope / q_rope [n, heads, *], own_rows [n, 1, L + R]; returns [n, heads, v]."""
    latent_dim = w_uk.shape[2]
    rows = own_rows if chunk.context_slots is None else \
        latent_cache.view(-1, latent_cache.shape[-1]).index_select(0, chunk.context_slots)
    rows = rows.reshape(-1, rows.shape[-1]).float()
    latent, k_rope = rows[:, :latent_dim], rows[:, latent_dim:]
    heads = w_uk.shape[0]
    keys = torch.cat([torch.matmul(latent, w_uk.float().transpose(1, 2)), k_rope.expand(heads, -1, -1)], dim=-1)
    values = torch.matmul(latent, w_uv.float())
    query = torch.cat([q_nope, q_rope], dim=-1).float().transpose(0, 1)
    n, seq_len = q_nope.shape[0], rows.shape[0]
    mask = None if n == seq_len else _visibility(n, seq_len, 0, None)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(0, 1).to(q_nope.dtype)
