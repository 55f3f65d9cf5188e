"""The batched pure-decode attention path equals kernels.reference.paged_attention."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.worker_proc.attention import attend, split_decodes
from pagedserve.worker_proc.decode_attention import build_decode_mask, decode_attention


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_pure_decode_attention_matches_the_reference_over_stale_nan_slots(sliding_window, q_heads, kv_heads):
    generator = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    block_size, head_dim, num_blocks = 4, 8, 40
    seq_lens = torch.tensor([1, 4, 5, 17, 30, 9], dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    permutation = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = []
    for seq_len in seq_lens.tolist():
        blocks = [permutation.pop() for _ in range(-(-seq_len // block_size))]
        for pos in range(seq_len):  # only the slots a request owns hold real data
            slot = (blocks[pos // block_size], pos % block_size)
            k_cache[slot] = torch.randn(kv_heads, head_dim, generator=generator)
            v_cache[slot] = torch.randn(kv_heads, head_dim, generator=generator)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
    block_tables = torch.tensor(tables, dtype=torch.int32)
    query = torch.randn(len(seq_lens), q_heads, head_dim, generator=generator)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    scale = head_dim**-0.5

    expected = reference.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                         seq_lens, scale, sliding_window)
    mask = build_decode_mask(seq_lens, int(seq_lens.max()), sliding_window)
    got = decode_attention(query, k_cache, v_cache, block_tables, scale, mask)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_mixed_batch_split_into_decodes_and_prefill_chunks_matches_the_reference():
    generator = torch.Generator().manual_seed(1)
    block_size, q_heads, kv_heads, head_dim = 4, 4, 2, 8
    num_scheduled = [1, 6, 1, 0, 3, 1]
    seq_lens = [9, 6, 14, 5, 12, 1]
    k_cache = torch.randn(32, block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(32, block_size, kv_heads, head_dim, generator=generator)
    block_tables = torch.randperm(32, generator=generator)[:24].view(6, 4).int()
    query_start_loc = [0]
    for n in num_scheduled:
        query_start_loc.append(query_start_loc[-1] + n)
    query = torch.randn(query_start_loc[-1], q_heads, head_dim, generator=generator)
    args = (k_cache, v_cache, block_tables, torch.tensor(query_start_loc, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), 0.3, 3)
    split = split_decodes(num_scheduled, query_start_loc, seq_lens, block_tables)
    got = attend(reference, query, *args, split)
    torch.testing.assert_close(got, reference.paged_attention(query, *args), rtol=1e-5, atol=1e-6)
