"""Which prompt chunks of a CPU step the native kernel takes (kernels/cpu_prefill_attention.c),
and the calls that run them: one for the chunks on their own keys (this step's K/V rows), one
for the chunks after cached context (their slots gathered from the cache once per layer).

Chunks with a sliding window inside them, and chunks longer than NATIVE_PREFILL_MAX_TOKENS
keys, stay on the SDPA path (prefill_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.prefill_attention import PrefillChunk

# Longer chunks go to SDPA: the native kernel re-reads K and V per 8 queries, and from ~2k
# keys on SDPA's larger tiles win (bench/scripts/cpu_prefill_bench.py; 1.2-1.6x faster below this).
NATIVE_PREFILL_MAX_TOKENS = 1536


def _longs(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass(slots=True)
class NativePrefill:
    own: Optional[tuple]  # (first rows, lengths) of the chunks on their own keys
    after_context: Optional[tuple]  # (first rows, key rows, context lengths, lengths, cache slots)
    rest: list[PrefillChunk]  # the chunks SDPA takes

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, out: torch.Tensor, scale: float, sinks: Optional[torch.Tensor] = None) -> None:
        if self.own is not None:
            cpu_native.prefill_attention(query, key, value, out, *self.own, scale, None, None, sinks)
        if self.after_context is not None:
            first, key_first, context, length, slots = self.after_context
            _, _, num_kv_heads, head_dim = k_cache.shape
            keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)  # this step's rows included
            values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
            cpu_native.prefill_attention(query, keys, values, out, first, length, scale, key_first, context, sinks)


def plan_native_prefill(chunks: list[PrefillChunk], sliding_window: Optional[int]) -> NativePrefill:
    own, after, rest = [], [], []
    for c in chunks:
        windowed = sliding_window is not None and 0 < sliding_window < c.seq_len
        if windowed or c.seq_len > NATIVE_PREFILL_MAX_TOKENS:
            rest.append(c)
        else:
            (own if c.context_slots is None else after).append(c)
    own_rows = (_longs([c.start for c in own]), _longs([c.end - c.start for c in own])) if own else None
    after_rows = None
    if after:
        key_first = [0]
        for c in after[:-1]:
            key_first.append(key_first[-1] + c.seq_len)
        after_rows = (_longs([c.start for c in after]), _longs(key_first),
                      _longs([c.seq_len - (c.end - c.start) for c in after]), _longs([c.end - c.start for c in after]),
                      torch.cat([c.context_slots for c in after]))
    return NativePrefill(own_rows, after_rows, rest)
