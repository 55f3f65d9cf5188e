"""A batched path for the requests of a step that decode exactly one token (CPU).

kernels.reference.paged_attention loops over requests in Python; for one query per
request the same result comes from gathering each request's blocks into a padded
[n, L] view and one scaled_dot_product_attention with an additive mask. What to gather
depends only on the step's sequence lengths and block tables, so the plan is built once
per step (per sliding window) and shared by every layer.

Two choices come from measurement (bench/log/2026-11-23.md, "Issue 12: grouped decode attention"):
- Whole blocks are gathered, not single slots: rows of block_size keys copy 20-30%
  faster. A block's slots outside what its request may see (the unfilled tail of its last
  block, the front of a sliding window, and the padding, which repeats the last block)
  are zeroed in the gathered copy, so a stale NaN there is never multiplied in, and then
  masked to -inf.
- Requests are sorted by length and cut into groups whose gathered K/V stay within
  GROUP_BYTES, one SDPA call per group: the gathered copy is then still in the core's
  cache when SDPA reads it, and short requests are not padded to the longest. On 64
  decodes of 64-384 keys this halves the layer's attention time.
The gathered K/V land in a GatherWorkspace kept across steps: a fresh multi-megabyte
buffer per layer costs more in page faults than the gather itself.

Where the native kernels are built (kernels/cpu_native.py: float32, bfloat16, float16) none
of this runs: the C kernel reads each request's blocks in place, 2-10x faster. This path serves
the other dtypes and machines without a C compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.prefill_attention import with_sink_key

# Gathered K + V of one group, in bytes of float32: about a core's L2. 0.5B shape and demo
# shape both measured best between 1 and 2 MiB (4-8x slower per key at 8+ MiB).
GROUP_BYTES = 3 << 19


class GatherWorkspace:
    """Two flat buffers (K and V) reused by every group, layer and step; grown, never shrunk."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def buffers(self, numel: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() < numel or self._buffers[0].dtype != dtype \
                or self._buffers[0].device != device:
            self._buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(2)]
        return [b[:numel] for b in self._buffers]


@dataclass(slots=True)
class DecodeGroup:
    start: int  # the group is requests [start, end) of the length-sorted order
    end: int
    blocks: torch.Tensor  # [n * num_blocks] long: the cache blocks to gather, request by request
    hidden: torch.Tensor  # [h] long: gathered key rows the request may not see (zeroed after the gather)
    bias: torch.Tensor  # [n, 1, 1, L] float32: 0 where attended, -inf elsewhere
    num_keys: int  # L = num_blocks * block_size


@dataclass(slots=True)
class DecodePlan:
    order: Optional[torch.Tensor]  # [B] long: requests by length; None when there is one group
    groups: list[DecodeGroup]


@dataclass(slots=True)
class DecodeContext:
    first: torch.Tensor  # [B] long: first visible position of each request
    last: torch.Tensor  # [B] long: its query's position (always visible)
    block_tables: torch.Tensor
    block_size: int
    workspace: Optional[GatherWorkspace] = None
    group_bytes: int = GROUP_BYTES
    _plans: dict[int, DecodePlan] = field(default_factory=dict)
    windowed: bool = False
    _tables_checked: bool = False

    def native_tables(self, num_blocks: int) -> torch.Tensor:
        """The block tables, checked once per step against the cache's size: the C kernel
        trusts every id it reads, where torch's indexing would raise."""
        if not self._tables_checked:
            ids = self.block_tables
            if self.windowed:  # only the blocks it reads: those before a window may be stale
                cols = torch.arange(ids.shape[1])[None, :]
                ids = ids[(cols >= (self.first // self.block_size)[:, None])
                          & (cols <= (self.last // self.block_size)[:, None])]
            low, high = torch.aminmax(ids) if ids.numel() else (0, 0)
            if int(low) < 0 or int(high) >= num_blocks:
                raise IndexError(f"block table names a block outside the cache of {num_blocks}")
            self._tables_checked = True
        return self.block_tables

    def plan(self, row_numel: int) -> DecodePlan:
        """The step's groups for a cache whose key row holds row_numel values (kv_heads * dim)."""
        if row_numel not in self._plans:
            self._plans[row_numel] = _plan_groups(self, row_numel)
        return self._plans[row_numel]


def build_decode_context(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, sliding_window: Optional[int]
) -> DecodeContext:
    """The query of request b sits at position seq_lens[b] - 1 and sees [first_b, seq_lens[b])."""
    last = seq_lens.long().cpu() - 1
    first = torch.zeros_like(last)
    windowed = sliding_window is not None and sliding_window > 0
    if windowed:
        first = (last - sliding_window + 1).clamp_(min=0)
    return DecodeContext(first, last, block_tables, block_size, windowed=windowed)


def _plan_groups(context: DecodeContext, row_numel: int) -> DecodePlan:
    bs = context.block_size
    first_block, last_block = context.first // bs, context.last // bs
    num_blocks = last_block - first_block + 1
    order = torch.argsort(num_blocks, stable=True)
    # Consecutive requests in length order, each group's padded K + V within the budget.
    budget_blocks = max(1, context.group_bytes // (2 * 4 * row_numel * bs))
    counts = num_blocks[order].tolist()
    cuts, start = [], 0
    for i in range(1, len(counts) + 1):
        if i == len(counts) or (i - start + 1) * counts[i] > budget_blocks:
            cuts.append((start, i))
            start = i
    if len(cuts) == 1:
        order = torch.arange(len(counts))
    first, last, first_block, last_block = (t[order] for t in (context.first, context.last, first_block, last_block))
    width = counts[-1] if len(cuts) > 1 else int(num_blocks.max())
    # Past its own blocks a request's row repeats its last block; those keys are hidden.
    index = (first_block[:, None] + torch.arange(width)[None, :]).minimum(last_block[:, None])
    blocks = context.block_tables.long().cpu()[order].gather(1, index)
    positions = first_block[:, None] * bs + torch.arange(width * bs)[None, :]
    visible = (positions >= first[:, None]) & (positions <= last[:, None])
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    device = context.block_tables.device
    groups = []
    for start, end in cuts:
        w = counts[end - 1] if len(cuts) > 1 else width
        hidden = (~visible[start:end, :w * bs]).reshape(-1).nonzero().squeeze(1)
        groups.append(DecodeGroup(start, end, blocks[start:end, :w].reshape(-1).to(device), hidden.to(device),
                                  bias[start:end, None, None, :w * bs].contiguous().to(device), w * bs))
    return DecodePlan(order.to(device) if len(cuts) > 1 else None, groups)


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, context: DecodeContext,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """query: [B, q_heads, dim], one token per request; returns [B, q_heads, dim].

    Same contract as kernels.reference.paged_attention restricted to one query per request
    (float32 arithmetic whatever the cache dtype); ``sinks`` [q_heads]: the layer's attention sinks.
    """
    if cpu_native.supports_decode(query, k_cache):
        return cpu_native.paged_decode_attention(query, k_cache, v_cache, context.native_tables(k_cache.shape[0]),
                                                 context.first, context.last, scale, sinks)
    batch, num_q_heads, head_dim = query.shape
    num_blocks_total, block_size, num_kv_heads = k_cache.shape[:3]
    row_numel = num_kv_heads * head_dim
    plan = context.plan(row_numel)
    flat_k = k_cache.view(num_blocks_total, block_size * row_numel)
    flat_v = v_cache.view(num_blocks_total, block_size * row_numel)
    group = num_q_heads // num_kv_heads
    queries = query.float() if plan.order is None else query.index_select(0, plan.order).float()
    queries = queries.view(batch, num_kv_heads, group, head_dim)
    out = torch.empty(batch, num_kv_heads, group, head_dim)
    for g in plan.groups:
        n = g.end - g.start
        shape = (n, g.num_keys, num_kv_heads, head_dim)
        if context.workspace is None:
            keys, values = flat_k.index_select(0, g.blocks), flat_v.index_select(0, g.blocks)
        else:
            k_buf, v_buf = context.workspace.buffers(n * g.num_keys * row_numel, k_cache.dtype, k_cache.device)
            keys = torch.index_select(flat_k, 0, g.blocks, out=k_buf.view(-1, block_size * row_numel))
            values = torch.index_select(flat_v, 0, g.blocks, out=v_buf.view(-1, block_size * row_numel))
        keys, values = keys.view(-1, row_numel), values.view(-1, row_numel)
        if g.hidden.numel():
            keys.index_fill_(0, g.hidden, 0.0)
            values.index_fill_(0, g.hidden, 0.0)
        # The query heads that share a KV head (consecutive, as HF's repeat_kv pairs them) go
        # in as that head's queries: plain multi-head attention with group-size queries,
        # which CPU SDPA runs ~3x faster than one query per head with enable_gqa.
        keys, values, bias = (keys.view(shape).float().transpose(1, 2), values.view(shape).float().transpose(1, 2),
                              g.bias)
        if sinks is not None:
            keys, values, bias = with_sink_key(keys, values, bias, sinks.view(1, num_kv_heads, group, 1))
        out[g.start:g.end] = F.scaled_dot_product_attention(queries[g.start:g.end], keys, values, attn_mask=bias,
                                                            scale=scale)
    if plan.order is not None:
        out = torch.empty_like(out).index_copy_(0, plan.order, out)
    return out.view(batch, num_q_heads, head_dim).to(query.dtype)
