"""Attention dispatch for one layer: on CPU, batched decodes and SDPA prefill chunks; elsewhere the kernel.

On CPU, kernels.reference.paged_attention loops over requests in Python and expands K/V
per query head, which dominates a step. So the requests that decode one token go through
decode_attention in one batched call, and each prefill chunk through one
scaled_dot_product_attention call (prefill_attention), except where the native kernel takes
them (native_prefill.py: a cache in the query's dtype, no window inside them, at most 1536
keys). On other devices, and whenever the step's ops are not the torch references (PAGEDSERVE_KERNELS=triton under TRITON_INTERPRET=1 on
CPU, which is how the tests run the Triton kernel inside a real forward pass), everything goes
to the kernel. The plan is computed once per step and shared by every layer.

Attention sinks (gpt-oss: a learned logit per query head that joins every softmax and weighs no value)
are computed by every path here: the native kernels, SDPA (as one more key of zeros whose score the
mask sets), the reference and the Triton kernel; ``sinks`` is None for every other family.

Attention soft-capping (Gemma 2: each scaled score s becomes c * tanh(s / c)) is in the reference
and the Triton kernel only: SDPA and the native CPU kernels cannot apply it, so on CPU a soft-capped
layer takes the reference for its whole batch (a Python loop over requests: slower, exact; the worker
says so in its log, ``SOFTCAP_ON_CPU``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from collections.abc import Sequence
from typing import Optional

import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc.decode_attention import (DecodeContext, GatherWorkspace, build_decode_context,
                                                     decode_attention)
from pagedserve.worker_proc.native_prefill import NativePrefill, plan_native_prefill
from pagedserve.worker_proc.prefill_attention import PrefillChunk, plan_prefill_chunk, prefill_attention

SOFTCAP_ON_CPU = ("attention soft-capping runs the torch reference attention on CPU (the native kernels and "
                  "SDPA cannot soft-cap)")


@dataclass(slots=True)
class CpuAttentionPlan:
    block_size: int
    decode_rows: Optional[torch.Tensor]  # [D] long: token rows (one per request) that decode; None if none
    decode_block_tables: Optional[torch.Tensor]
    decode_seq_lens: Optional[torch.Tensor]
    all_decode: bool  # every row of the batch is a decode, in order
    chunks: list[PrefillChunk]  # the requests with more than one query
    workspace: Optional[GatherWorkspace] = None
    contexts: dict[Optional[int], DecodeContext] = field(default_factory=dict)
    natives: dict[Optional[int], NativePrefill] = field(default_factory=dict)

    def decode_context(self, sliding_window: Optional[int]) -> DecodeContext:
        if sliding_window not in self.contexts:
            context = build_decode_context(self.decode_seq_lens, self.decode_block_tables, self.block_size,
                                           sliding_window)
            context.workspace = self.workspace
            self.contexts[sliding_window] = context
        return self.contexts[sliding_window]


    def native_prefill(self, sliding_window: Optional[int]) -> NativePrefill:
        if sliding_window not in self.natives:
            self.natives[sliding_window] = plan_native_prefill(self.chunks, sliding_window)
        return self.natives[sliding_window]


def plan_cpu_attention(num_scheduled: Sequence[int], query_start_loc: Sequence[int], seq_lens: Sequence[int],
                       block_tables: torch.Tensor, block_size: int,
                       workspace: Optional[GatherWorkspace] = None) -> CpuAttentionPlan:
    """Separate one-token requests from prefill chunks (CPU tensors)."""
    decoding = [b for b, n in enumerate(num_scheduled) if n == 1]
    chunks = [plan_prefill_chunk(query_start_loc[b], query_start_loc[b + 1], seq_lens[b], block_tables[b], block_size)
              for b, n in enumerate(num_scheduled) if n > 1]
    plan = CpuAttentionPlan(block_size, None, None, None, not chunks and len(decoding) == len(num_scheduled), chunks,
                            workspace)
    if decoding:
        all_rows = len(decoding) == len(num_scheduled)
        plan.decode_rows = torch.tensor([query_start_loc[b] for b in decoding], dtype=torch.long)
        plan.decode_block_tables = block_tables if all_rows else block_tables[decoding]
        plan.decode_seq_lens = torch.tensor([seq_lens[b] for b in decoding], dtype=torch.int32)
    return plan


def attend(ops: ModuleType, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, sliding_window: Optional[int], plan: Optional[CpuAttentionPlan],
           softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """paged_attention's contract: query [T, heads, dim] over the step's ragged batch.

    key/value are this step's rows [T, kv_heads, dim], already written to the cache; ``sinks``
    [heads] float32, the layer's attention sinks, or None.
    """
    if plan is None or ops is not reference or softcap is not None:
        return ops.paged_attention(query.contiguous(), k_cache, v_cache, block_tables, query_start_loc,
                                   seq_lens, scale, sliding_window, softcap, sinks)
    if plan.all_decode:
        return decode_attention(query, k_cache, v_cache, scale, plan.decode_context(sliding_window), sinks)
    rest, native = plan.chunks, None
    if k_cache.dtype == query.dtype and cpu_native.supports_prefill(query, key):
        native = plan.native_prefill(sliding_window)
        rest = native.rest
    elif plan.decode_rows is None and len(rest) == 1 and rest[0].end - rest[0].start == query.shape[0]:
        return prefill_attention(query, key, value, k_cache, v_cache, rest[0], scale, sliding_window, sinks)
    out = torch.empty(query.shape, dtype=query.dtype)
    if native is not None:
        native.run(query, key, value, k_cache, v_cache, out, scale, sinks)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = decode_attention(query[plan.decode_rows], k_cache, v_cache, scale,
                                                 plan.decode_context(sliding_window), sinks)
    for c in rest:
        out[c.start:c.end] = prefill_attention(query[c.start:c.end], key[c.start:c.end], value[c.start:c.end],
                                               k_cache, v_cache, c, scale, sliding_window, sinks)
    return out
