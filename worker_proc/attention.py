"""Attention dispatch for one layer: decodes through the batched path on CPU, the rest through the kernel.

On CPU, kernels.reference.paged_attention loops over requests in Python, which dominates
a step of many short decodes. So the requests that decode one token go through
decode_attention in one batched call, and only the others (prefill chunks) go through
ops.paged_attention, as a smaller ragged batch. On other devices everything goes to the
kernel. The split is computed once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

import torch

from pagedserve.worker_proc.decode_attention import DecodeMask, build_decode_mask, decode_attention


@dataclass(slots=True)
class DecodeSplit:
    decode_rows: torch.Tensor  # [D] long: token rows (one per request) that decode
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_max_len: int
    # The rest of the batch as its own ragged batch; None when every request decodes.
    other_rows: Optional[torch.Tensor] = None
    other_block_tables: Optional[torch.Tensor] = None
    other_query_start_loc: Optional[torch.Tensor] = None
    other_seq_lens: Optional[torch.Tensor] = None
    masks: dict[Optional[int], DecodeMask] = field(default_factory=dict)

    def mask(self, sliding_window: Optional[int]) -> DecodeMask:
        if sliding_window not in self.masks:
            self.masks[sliding_window] = build_decode_mask(self.decode_seq_lens, self.decode_max_len, sliding_window)
        return self.masks[sliding_window]


def split_decodes(num_scheduled: list[int], query_start_loc: list[int], seq_lens: list[int],
                  block_tables: torch.Tensor) -> Optional[DecodeSplit]:
    """Separate one-token requests from the rest (CPU tensors); None when none decodes."""
    decoding = [b for b, n in enumerate(num_scheduled) if n == 1]
    if not decoding:
        return None
    others = [b for b, n in enumerate(num_scheduled) if n > 1]
    split = DecodeSplit(
        decode_rows=torch.tensor([query_start_loc[b] for b in decoding], dtype=torch.long),
        decode_block_tables=block_tables[decoding],
        decode_seq_lens=torch.tensor([seq_lens[b] for b in decoding], dtype=torch.int32),
        decode_max_len=max(seq_lens[b] for b in decoding),
    )
    if others:
        rows: list[int] = []
        starts = [0]
        for b in others:
            rows += range(query_start_loc[b], query_start_loc[b + 1])
            starts.append(len(rows))
        split.other_rows = torch.tensor(rows, dtype=torch.long)
        split.other_block_tables = block_tables[others]
        split.other_query_start_loc = torch.tensor(starts, dtype=torch.int32)
        split.other_seq_lens = torch.tensor([seq_lens[b] for b in others], dtype=torch.int32)
    return split


def attend(ops: ModuleType, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, sliding_window: Optional[int], split: Optional[DecodeSplit]) -> torch.Tensor:
    """paged_attention's contract: query [T, heads, dim] over the step's ragged batch."""
    if split is None:
        return ops.paged_attention(query.contiguous(), k_cache, v_cache, block_tables, query_start_loc,
                                   seq_lens, scale, sliding_window)
    mask = split.mask(sliding_window)
    if split.other_rows is None and split.decode_rows.numel() == query.shape[0]:
        return decode_attention(query, k_cache, v_cache, split.decode_block_tables, scale, mask)
    out = torch.empty_like(query)
    out[split.decode_rows] = decode_attention(query[split.decode_rows], k_cache, v_cache,
                                              split.decode_block_tables, scale, mask)
    if split.other_rows is not None:
        out[split.other_rows] = ops.paged_attention(
            query[split.other_rows], k_cache, v_cache, split.other_block_tables,
            split.other_query_start_loc, split.other_seq_lens, scale, sliding_window)
    return out
