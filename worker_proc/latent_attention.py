"""Multi-head latent attention over the latent paged cache, with absorbed up-projections (DeepSeek).

Each head's q_nope goes through its W_UK into the latent's space, so its scores are products
with the cached latent rows themselves (c, k_rope), and the attention output in that space goes
through W_UV to the head's values (models/deepseek.py says why). In between the attention is
multi-query over one "KV head" of width L + R whose value is its first L dims:

- on CPU (the torch references as ops) it takes worker_proc/attention.py's paths, planned once per
  step like every layer's: the native decode kernel, the native prefill kernel (widths it tiles),
  SDPA; they read the latent row as both K and V and the output's last R dims are dropped;
- elsewhere (the Triton ops: CUDA, or PAGEDSERVE_KERNELS=triton under TRITON_INTERPRET=1) the
  MLA kernel (kernels/mla_attention.py), which reads each row once and returns only the L dims.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pagedserve.kernels import reference
from pagedserve.worker_proc.attention import CpuAttentionPlan, attend


def latent_attention(ops: ModuleType, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_rows: torch.Tensor,
                     w_uk: torch.Tensor, w_uv: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     plan: Optional[CpuAttentionPlan]) -> torch.Tensor:
    """q_nope [T, heads, nope], q_rope [T, heads, R] (rotated), this step's latent rows [T, 1, L + R]
    (already written to ``latent_cache`` [blocks, block_size, 1, L + R]); w_uk [heads, nope, L],
    w_uv [heads, L, v]. Returns each head's attention values [T, heads, v]."""
    latent_dim = w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    query = torch.cat([q_latent, q_rope], dim=-1)
    if ops is reference and plan is not None:
        rows = attend(ops, query, latent_rows, latent_rows, latent_cache, latent_cache, block_tables, query_start_loc,
                      seq_lens, scale, None, plan)[..., :latent_dim]
    else:
        rows = ops.mla_attention(query, latent_cache, block_tables, query_start_loc, seq_lens, scale, latent_dim)
    return torch.bmm(rows.transpose(0, 1), w_uv).transpose(0, 1)
