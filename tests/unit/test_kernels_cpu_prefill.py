"""The native CPU prefill attention (kernels/cpu_prefill_attention.c): chunks attending
causally to their own keys, or to cached context and then their own, equal softmax attention
computed in float64, write only their own rows, and give the same bits on any thread count;
through ``attend`` a mixed step still equals kernels.reference.paged_attention."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc import native_prefill
from pagedserve.worker_proc.attention import attend, plan_cpu_attention
from support.attention import causal_attention_f64, nan_cache_with_requests, qkv_rows

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (7, 1), (4, 4), (14, 2)])
def test_chunks_attend_causally_to_their_own_keys_and_write_only_their_rows(head_dim, q_heads, kv_heads):
    generator = torch.Generator().manual_seed(head_dim + q_heads)
    # lengths around the kernel's query tiles (4 or 8) and key tiles (16 or 32); rows 40..42
    # and the last 5 are no chunk's
    first, length = [0, 1, 9, 43, 76, 109, 309, 349, 352, 357, 372], [1, 8, 31, 33, 33, 200, 40, 3, 5, 15, 17]
    total = first[-1] + length[-1] + 5
    query, key, value = qkv_rows(total, q_heads, kv_heads, head_dim, generator)
    out = torch.full((total, q_heads, head_dim), float("nan"))
    cpu_native.prefill_attention(query, key, value, out, torch.tensor(first), torch.tensor(length), 0.2)
    expected = causal_attention_f64(query, key, value, first, length, 0.2)
    # float32 sums of head_dim products: SDPA itself is 0.6e-6 (head_dim 32) to 3.7e-6 (128) off
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=8e-6, equal_nan=True)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_chunks_after_cached_context_see_it_all_and_their_own_keys_causally(head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    first, length, context = [0, 5, 45], [5, 40, 9], [300, 7, 0]  # a follow-up turn, a chunk continuation, none
    key_first = [0, 305, 352]  # keys: each chunk's context, then its own rows
    query, _, _ = qkv_rows(60, 4, 2, head_dim, generator)
    _, key, value = qkv_rows(361, 4, 2, head_dim, generator)
    out = torch.full((60, 4, head_dim), float("nan"))
    cpu_native.prefill_attention(query, key, value, out, torch.tensor(first), torch.tensor(length), 0.2,
                                 torch.tensor(key_first), torch.tensor(context))
    expected = causal_attention_f64(query, key, value, first, length, 0.2, key_first, context)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=8e-6, equal_nan=True)


def test_a_chunk_outside_its_tensors_is_an_error_not_a_wild_read():
    query, key, value = qkv_rows(40, 4, 2, 32, torch.Generator().manual_seed(1))
    out = torch.empty(40, 4, 32)
    for first, length, key_first, context in (([30], [11], None, None), ([0], [8], [0], [33]), ([-1], [4], None, None)):
        with pytest.raises(IndexError, match="outside"):
            cpu_native.prefill_attention(query, key, value, out, torch.tensor(first), torch.tensor(length), 0.2,
                                         None if key_first is None else torch.tensor(key_first),
                                         None if context is None else torch.tensor(context))


def test_threads_split_heads_and_query_blocks_so_the_answer_does_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(5)
    query, key, value = qkv_rows(700, 14, 2, 64, generator)
    first, length = torch.tensor([0, 300]), torch.tensor([300, 400])
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(700, 14, 64)
            cpu_native.prefill_attention(query, key, value, out, first, length, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("sliding_window", [None, 5, 300])
def test_a_mixed_step_takes_the_native_kernel_for_its_chunks_and_matches_the_reference(sliding_window,
                                                                                          monkeypatch):
    calls = []
    kernel = cpu_native.prefill_attention
    monkeypatch.setattr(cpu_native, "prefill_attention", lambda *a: calls.append(a[4].tolist()) or kernel(*a))
    generator = torch.Generator().manual_seed(11)
    head_dim, q_heads, kv_heads, block_size = 32, 4, 2, 4
    # decode, fresh prompt, chunk after 9 cached tokens, decode, fresh prompt, one too long for the kernel
    monkeypatch.setattr(native_prefill, "NATIVE_PREFILL_MAX_TOKENS", 20)
    num_scheduled, seq_lens = [1, 19, 3, 1, 13, 21], [9, 19, 12, 30, 13, 21]
    k_cache, v_cache, block_tables = nan_cache_with_requests(seq_lens, kv_heads, generator, block_size=block_size,
                                                             head_dim=head_dim)
    starts = [0]
    for n in num_scheduled:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], q_heads, head_dim, generator=generator)
    key = torch.empty(starts[-1], kv_heads, head_dim)  # this step's rows: what write_kv put in the cache
    value = torch.empty_like(key)
    for b, (n, seq_len) in enumerate(zip(num_scheduled, seq_lens)):
        for i, pos in enumerate(range(seq_len - n, seq_len)):
            slot = (int(block_tables[b, pos // block_size]), pos % block_size)
            key[starts[b] + i], value[starts[b] + i] = k_cache[slot], v_cache[slot]
    args = (k_cache, v_cache, block_tables, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), 0.3, sliding_window)
    plan = plan_cpu_attention(num_scheduled, starts, seq_lens, block_tables, block_size)
    got = attend(reference, query, key, value, *args, plan)
    torch.testing.assert_close(got, reference.paged_attention(query, *args), rtol=1e-5, atol=1e-6)
    # fresh prompts in one call, the chunk after cached context in another; a window shorter than
    # a chunk masks inside it, and a long prompt is SDPA's: those take that path
    assert calls == {None: [[1, 24], [20]], 5: [], 300: [[1, 24], [20]]}[sliding_window]
