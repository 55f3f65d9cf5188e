"""The CPU attention paths (batched decodes, SDPA prefill chunks) equal kernels.reference.paged_attention.

Decodes run through the native kernel where it is built (kernels/cpu_native.py) and through
the gather + SDPA path otherwise; the ``decode_path`` fixture runs each test on both."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc.attention import attend, plan_cpu_attention
from pagedserve.worker_proc.decode_attention import (GROUP_BYTES, GatherWorkspace, build_decode_context,
                                                     decode_attention)

from support.attention import BLOCK_SIZE, HEAD_DIM, nan_cache_with_requests


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    if request.param == "native":
        if cpu_native.library() is None:
            pytest.skip("native CPU kernels are not built on this machine (no C compiler)")
    else:
        monkeypatch.setattr(cpu_native, "supports_decode", lambda *_: False)
    return request.param


@pytest.mark.parametrize("use_workspace", [False, True])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("group_bytes", [GROUP_BYTES, 2 * 4 * 8 * BLOCK_SIZE * HEAD_DIM])
def test_pure_decode_attention_matches_the_reference_over_stale_nan_slots(sliding_window, q_heads, kv_heads,
                                                                         use_workspace, group_bytes, decode_path):
    """Stale NaN in tails, padding and outside the window never leaks, in one group or many
    (the small budget cuts the six requests, sorted by length, into several groups)."""
    generator = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    seq_lens = [1, 4, 5, 17, 30, 9]
    k_cache, v_cache, block_tables = nan_cache_with_requests(seq_lens, kv_heads, generator)
    query = torch.randn(len(seq_lens), q_heads, HEAD_DIM, generator=generator)
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    expected = reference.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                         lens, scale, sliding_window)
    context = build_decode_context(lens, block_tables, BLOCK_SIZE, sliding_window)
    context.workspace = GatherWorkspace() if use_workspace else None
    context.group_bytes = group_bytes
    assert (len(context.plan(kv_heads * HEAD_DIM).groups) > 1) == (group_bytes != GROUP_BYTES)
    for _ in range(2):  # a reused workspace gives the same answer
        got = decode_attention(query, k_cache, v_cache, scale, context)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sliding_window", [None, 3, 7])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (6, 1), (2, 2)])
def test_a_mixed_batch_of_decodes_fresh_prompts_and_chunks_after_cached_context_matches_the_reference(
        sliding_window, q_heads, kv_heads, decode_path):
    generator = torch.Generator().manual_seed(q_heads + 7 * kv_heads)
    # decode, fresh prompt, decode, idle, chunk after 9 cached tokens, decode, fresh 1-block prompt
    num_scheduled = [1, 6, 1, 0, 3, 1, 13]
    seq_lens = [9, 6, 14, 5, 12, 1, 13]
    k_cache, v_cache, block_tables = nan_cache_with_requests(seq_lens, kv_heads, generator)
    query_start_loc = [0]
    for n in num_scheduled:
        query_start_loc.append(query_start_loc[-1] + n)
    total = query_start_loc[-1]
    query = torch.randn(total, q_heads, HEAD_DIM, generator=generator)
    # This step's own K/V rows, as the layer passes them: what write_kv put in the cache.
    key = torch.empty(total, kv_heads, HEAD_DIM)
    value = torch.empty_like(key)
    for b, (n, seq_len) in enumerate(zip(num_scheduled, seq_lens)):
        for i, pos in enumerate(range(seq_len - n, seq_len)):
            slot = (int(block_tables[b, pos // BLOCK_SIZE]), pos % BLOCK_SIZE)
            key[query_start_loc[b] + i] = k_cache[slot]
            value[query_start_loc[b] + i] = v_cache[slot]
    args = (k_cache, v_cache, block_tables, torch.tensor(query_start_loc, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), 0.3, sliding_window)
    plan = plan_cpu_attention(num_scheduled, query_start_loc, seq_lens, block_tables, BLOCK_SIZE, GatherWorkspace())
    got = attend(reference, query, key, value, *args, plan)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, reference.paged_attention(query, *args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_a_step_of_one_fresh_prompt_reads_its_own_rows_not_the_cache(sliding_window):
    generator = torch.Generator().manual_seed(3)
    seq_len, q_heads, kv_heads = 10, 4, 2
    k_cache, v_cache, block_tables = nan_cache_with_requests([seq_len], kv_heads, generator)
    rows = [(int(block_tables[0, p // BLOCK_SIZE]), p % BLOCK_SIZE) for p in range(seq_len)]
    key = torch.stack([k_cache[r] for r in rows])
    value = torch.stack([v_cache[r] for r in rows])
    query = torch.randn(seq_len, q_heads, HEAD_DIM, generator=generator)
    args = (block_tables, torch.tensor([0, seq_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
            0.3, sliding_window)
    expected = reference.paged_attention(query, k_cache, v_cache, *args)
    plan = plan_cpu_attention([seq_len], [0, seq_len], [seq_len], block_tables, BLOCK_SIZE)
    poisoned = torch.full_like(k_cache, float("nan"))  # the cache is not read at all
    got = attend(reference, query, key, value, poisoned, poisoned, *args, plan)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
