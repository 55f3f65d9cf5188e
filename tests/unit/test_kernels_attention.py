"""Triton paged attention matches the torch reference on ragged batches.

Runs under TRITON_INTERPRET=1 on CPU, or natively on a GPU (see kernel_device). Every cache
slot a request does not own, including the tail of its last block, holds a stale NaN, as
memory handed back by an earlier request may: the kernel must mask it out rather than
multiply it by zero.
"""

from support.kernel_device import MARKS, to_device  # first: it decides TRITON_INTERPRET before triton loads

import pytest
import torch

from pagedserve.kernels import reference, triton_ops

pytestmark = MARKS

# (seq_len, query tokens this step): fresh decode, decode, whole prefill, chunked prefill
# spanning more than one key tile, an idle request, decode, and a chunk of 150 queries after
# 50 keys, which spans two of the long launch's 128-row tiles; all in one batch. Which
# requests are short (one launch) or long (the other) depends on the group: 6 queries are
# short for a group of 1 or 2 (8 or 16 tokens a short tile), long for a group of 3 or 4.
RAGGED_BATCH = [(1, 1), (17, 1), (19, 19), (40, 6), (7, 0), (9, 1), (200, 150)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def build_batch(requests, block_size, kv_heads, group, head_dim, dtype, seed):
    """Query, NaN-poisoned caches holding random K/V for every live position, and the metadata."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_request = [-(-seq_len // block_size) for seq_len, _ in requests]
    num_blocks = sum(blocks_per_request) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.full((len(requests), max(blocks_per_request)), -1, dtype=torch.int32)
    for request, ((seq_len, _), count) in enumerate(zip(requests, blocks_per_request)):
        blocks = [free_blocks.pop() for _ in range(count)]
        block_tables[request, :count] = torch.tensor(blocks)
        for position in range(seq_len):
            block, slot = blocks[position // block_size], position % block_size
            k_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=generator).to(dtype)
            v_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=generator).to(dtype)
    query_lens = torch.tensor([q_len for _, q_len in requests])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]).to(torch.int32)
    query = torch.randn(int(query_lens.sum()), kv_heads * group, head_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor([seq_len for seq_len, _ in requests], dtype=torch.int32)
    return query, k_cache, v_cache, block_tables, query_start_loc, seq_lens


@pytest.mark.parametrize(
    "dtype, block_size, kv_heads, group, head_dim, sliding_window",
    [
        (torch.float32, 1, 1, 4, 40, None),
        (torch.float32, 3, 2, 2, 16, 5),
        (torch.bfloat16, 16, 2, 1, 32, None),
        (torch.float16, 16, 3, 2, 40, 7),
        (torch.bfloat16, 3, 1, 3, 16, 4),  # a group of 3 query heads pads to 4 rows per token
        (torch.float32, 16, 2, 2, 128, None),  # the float32 long tile at a real model's head size
    ],
)
def test_ragged_batch_of_decodes_and_prefills_matches_reference_despite_stale_nan_slots(
    dtype, block_size, kv_heads, group, head_dim, sliding_window
):
    batch = to_device(*build_batch(RAGGED_BATCH, block_size, kv_heads, group, head_dim, dtype, seed=11))
    scale = head_dim**-0.5

    out = triton_ops.paged_attention(*batch, scale, sliding_window)
    expected = reference.paged_attention(*batch, scale, sliding_window)

    assert out.dtype == dtype and out.shape == batch[0].shape
    assert torch.isfinite(out).all()
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("splits, sliding_window", [(1, None), (3, None), (4, 20)])
def test_a_step_of_decodes_only_matches_reference(splits, sliding_window):
    # num_tokens == num_requests: only the short launch runs (as in every CUDA-graph replay),
    # with each request's keys in ``splits`` parts; a 1-key request leaves most parts empty.
    batch = to_device(*build_batch([(1, 1), (170, 1), (33, 1), (16, 1)], 16, 2, 2, 32, torch.float32, seed=14))

    out = triton_ops.paged_attention(*batch, 0.2, sliding_window, decode_splits=splits)

    expected = reference.paged_attention(*batch, 0.2, sliding_window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits, sliding_window", [(1, None), (3, 6)])
def test_soft_capped_scores_match_the_reference_and_differ_from_uncapped_attention(splits, sliding_window):
    """Gemma 2's cap * tanh(score / cap), in decode-only steps (split or not) and a ragged batch. The
    scale is large enough that scores reach the cap, so capping changes the result."""
    batch = to_device(*build_batch(RAGGED_BATCH, 4, 2, 2, 16, torch.float32, seed=15))
    decodes = to_device(*build_batch([(1, 1), (70, 1), (33, 1)], 16, 2, 2, 16, torch.float32, seed=16))
    for args in (batch, decodes):
        out = triton_ops.paged_attention(*args, 1.0, sliding_window, 2.5, decode_splits=splits)
        expected = reference.paged_attention(*args, 1.0, sliding_window, 2.5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
        assert not torch.allclose(expected, reference.paged_attention(*args, 1.0, sliding_window), atol=1e-2)


def test_query_given_as_a_strided_slice_of_a_fused_projection_gives_the_same_result():
    query, *rest = build_batch([(5, 5), (12, 1)], 3, 1, 2, 16, torch.float32, seed=12)
    fused = torch.cat([query, torch.full_like(query, float("nan"))], dim=1)
    fused, query, *rest = to_device(fused, query, *rest)
    strided_query = fused[:, : query.shape[1]]

    out = triton_ops.paged_attention(strided_query, *rest, 0.25)

    torch.testing.assert_close(out, reference.paged_attention(query, *rest, 0.25), atol=2e-5, rtol=2e-5)


def test_zeroing_fresh_blocks_of_a_nan_poisoned_cache_makes_attention_over_them_finite():
    num_layers, num_blocks, block_size, kv_heads, head_dim = 2, 6, 3, 1, 16
    kv_cache = torch.full((num_layers, 2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    generator = torch.Generator().manual_seed(13)
    seq_len, fresh_blocks = 5, torch.tensor([4, 1])  # 5 tokens in 2 blocks: the last slot stays unused

    key = torch.randn(seq_len, kv_heads, head_dim, generator=generator)
    value = torch.randn(seq_len, kv_heads, head_dim, generator=generator)
    query = torch.randn(seq_len, 2 * kv_heads, head_dim, generator=generator)
    slots = torch.tensor([4 * block_size + i for i in range(3)] + [1 * block_size + i for i in range(2)])
    kv_cache, fresh_blocks, key, value, query, slots = to_device(kv_cache, fresh_blocks, key, value, query, slots)

    triton_ops.zero_blocks(kv_cache, fresh_blocks)
    layer = 1
    triton_ops.write_kv(key, value, kv_cache[layer, 0], kv_cache[layer, 1], slots)
    assert not kv_cache[:, :, fresh_blocks].isnan().any()

    metadata = (
        *to_device(fresh_blocks[None].to(torch.int32), torch.tensor([0, seq_len]), torch.tensor([seq_len])),
        0.25,
    )
    out = triton_ops.paged_attention(query, kv_cache[layer, 0], kv_cache[layer, 1], *metadata)
    expected = reference.paged_attention(query, kv_cache[layer, 0], kv_cache[layer, 1], *metadata)

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits, sliding_window", [(1, None), (3, None), (3, 6)])
def test_attention_sinks_match_the_reference_in_ragged_and_split_decode_steps(splits, sliding_window):
    """gpt-oss's sinks (a logit per query head in every softmax, weighing no value): a ragged batch
    (both launches), and decode-only steps with each request's keys split (the sink counted once)."""
    batch = to_device(*build_batch(RAGGED_BATCH, 4, 2, 2, 16, torch.float32, seed=17))
    decodes = to_device(*build_batch([(1, 1), (70, 1), (33, 1), (2, 1)], 16, 2, 3, 16, torch.float32, seed=18))
    for args in (batch, decodes):
        q_heads = args[0].shape[1]
        sinks = to_device(torch.randn(q_heads, generator=torch.Generator().manual_seed(q_heads)) * 2.0 + 1.0)[0]
        out = triton_ops.paged_attention(*args, 0.3, sliding_window, None, sinks, decode_splits=splits)
        expected = reference.paged_attention(*args, 0.3, sliding_window, None, sinks)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
        assert not torch.allclose(expected, reference.paged_attention(*args, 0.3, sliding_window), atol=1e-3)
