"""Attention sinks (gpt-oss: a learned logit per query head in every softmax, weighing no value) on
every CPU attention path: the torch reference against transformers' own eager attention, then the
native decode kernels (float32, bfloat16 and float16; each x86-64 level this CPU runs in
tests/e2e/test_kernels_cpu_sinks.py), the native
prefill kernel, and both SDPA paths (the gathered decode and the prompt chunk), each against the
reference on a NaN-poisoned paged cache. Without sinks every path gives the bits it gave before."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc import native_prefill
from pagedserve.worker_proc.attention import attend, plan_cpu_attention
from pagedserve.worker_proc.decode_attention import build_decode_context, decode_attention
from support.attention import nan_cache_with_requests

needs_library = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")


def sinks_for(q_heads: int, generator: torch.Generator) -> torch.Tensor:
    """Logits of the scores' size and larger, so each sink takes a real share of every row."""
    return torch.randn(q_heads, generator=generator) * 2.0 + 1.0


def test_the_reference_equals_transformers_eager_attention_with_sinks():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    q_heads, kv_heads, head_dim, seq_len, window = 4, 2, 16, 11, 4
    query = torch.randn(seq_len, q_heads, head_dim, generator=generator)
    k_cache, v_cache, tables = nan_cache_with_requests([seq_len], kv_heads, generator, block_size=4, head_dim=head_dim)
    keys = k_cache[tables[0].long()].reshape(-1, kv_heads, head_dim)[:seq_len]
    values = v_cache[tables[0].long()].reshape(-1, kv_heads, head_dim)[:seq_len]
    sinks = sinks_for(q_heads, generator)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = q_heads // kv_heads, sinks, False
    pos = torch.arange(seq_len)
    for w in (None, window):
        visible = pos[None, :] <= pos[:, None]
        if w is not None:
            visible &= pos[:, None] - pos[None, :] < w
        mask = torch.zeros(seq_len, seq_len).masked_fill_(~visible, float("-inf"))[None, None]
        theirs, _ = eager_attention_forward(module, query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                            values.transpose(0, 1)[None], mask, 0.3)
        ours = reference.paged_attention(query, k_cache, v_cache, tables, torch.tensor([0, seq_len]),
                                         torch.tensor([seq_len]), 0.3, w, sinks=sinks)
        torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ours, reference.paged_attention(query, k_cache, v_cache, tables,
                                                                  torch.tensor([0, seq_len]), torch.tensor([seq_len]),
                                                                  0.3, w), atol=1e-3)


@needs_library
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(64, 8, 2), (40, 7, 1), (32, 4, 4)])
def test_native_decode_with_sinks_equals_the_reference(window, head_dim, q_heads, kv_heads):
    generator = torch.Generator().manual_seed(head_dim + q_heads)
    seq_lens = [1, 3, 17, 64]
    k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, kv_heads, generator, block_size=16,
                                                       head_dim=head_dim)
    query = torch.randn(len(seq_lens), q_heads, head_dim, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    sinks = sinks_for(q_heads, generator)
    context = build_decode_context(lens, tables, 16, window)
    args = (k_cache, v_cache, tables, torch.arange(len(seq_lens) + 1, dtype=torch.int32), lens, head_dim ** -0.5,
            window)
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        q, kc, vc = query.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        got = cpu_native.paged_decode_attention(q, kc, vc, context.native_tables(kc.shape[0]), context.first,
                                                context.last, head_dim ** -0.5, sinks)
        expected = reference.paged_attention(q.float(), kc.float(), vc.float(), *args[2:], sinks=sinks)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
        if dtype == torch.float32:  # no sinks: the same bits as the kernel's call without the argument
            plain = cpu_native.paged_decode_attention(q, kc, vc, context.native_tables(kc.shape[0]), context.first,
                                                      context.last, head_dim ** -0.5)
            assert torch.equal(plain, cpu_native.paged_decode_attention(
                q, kc, vc, context.native_tables(kc.shape[0]), context.first, context.last, head_dim ** -0.5, None))
            assert not torch.allclose(plain, got, atol=1e-3)


def mixed_step(generator, head_dim=32, q_heads=4, kv_heads=2, block_size=4):
    """A decode, a fresh prompt, a chunk after 9 cached tokens, a decode, a fresh prompt and one too
    long for the native prefill kernel (NATIVE_PREFILL_MAX_TOKENS is set to 20 by the test)."""
    num_scheduled, seq_lens = [1, 19, 3, 1, 13, 21], [9, 19, 12, 30, 13, 21]
    k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, kv_heads, generator, block_size=block_size,
                                                       head_dim=head_dim)
    starts = [0]
    for n in num_scheduled:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], q_heads, head_dim, generator=generator)
    key = torch.empty(starts[-1], kv_heads, head_dim)  # this step's rows, as write_kv put them in the cache
    value = torch.empty_like(key)
    for b, (n, seq_len) in enumerate(zip(num_scheduled, seq_lens)):
        for i, pos in enumerate(range(seq_len - n, seq_len)):
            slot = (int(tables[b, pos // block_size]), pos % block_size)
            key[starts[b] + i], value[starts[b] + i] = k_cache[slot], v_cache[slot]
    plan = plan_cpu_attention(num_scheduled, starts, seq_lens, tables, block_size)
    meta = (tables, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32))
    return query, key, value, k_cache, v_cache, meta, plan


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "torch SDPA paths"])
@pytest.mark.parametrize("window", [None, 5])
def test_a_mixed_step_with_sinks_equals_the_reference_on_every_cpu_path(monkeypatch, native, window):
    """Decodes, fresh prompts, a chunk after cached context and a prompt SDPA takes, in one step through
    ``attend``: the native decode and prefill kernels where they are built, else (and with the library
    off) the gathered decode's and the prompt chunk's SDPA with the sink as one more key."""
    if native and cpu_native.library() is None:
        pytest.skip("no C compiler on this machine")
    if not native:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    monkeypatch.setattr(native_prefill, "NATIVE_PREFILL_MAX_TOKENS", 20)
    generator = torch.Generator().manual_seed(7)
    query, key, value, k_cache, v_cache, meta, plan = mixed_step(generator)
    sinks = sinks_for(query.shape[1], generator)
    got = attend(reference, query, key, value, k_cache, v_cache, *meta, 0.3, window, plan, sinks=sinks)
    expected = reference.paged_attention(query, k_cache, v_cache, *meta, 0.3, window, sinks=sinks)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    # a step of decodes only takes the batched decode path
    decodes = [0, 3]
    rows = torch.tensor([int(meta[1][b]) for b in decodes])
    seq_lens = meta[2][decodes]
    only_decodes = (meta[0][decodes], torch.arange(3, dtype=torch.int32), seq_lens)
    decode_plan = plan_cpu_attention([1, 1], [0, 1, 2], seq_lens.tolist(), meta[0][decodes], 4)
    got = attend(reference, query[rows], key[rows], value[rows], k_cache, v_cache, *only_decodes, 0.3, window,
                 decode_plan, sinks=sinks)
    torch.testing.assert_close(got, reference.paged_attention(query[rows], k_cache, v_cache, *only_decodes, 0.3,
                                                              window, sinks=sinks), rtol=1e-5, atol=2e-6)


def test_the_gathered_decode_path_gives_the_sink_its_share_in_every_group(monkeypatch):
    """The torch decode path cuts long batches into groups (one SDPA each): the sink joins each."""
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    generator = torch.Generator().manual_seed(3)
    seq_lens = [5, 40, 90, 7, 130]
    k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, 2, generator, block_size=4, head_dim=8,
                                                       num_blocks=128)
    query = torch.randn(len(seq_lens), 4, 8, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    sinks = sinks_for(4, generator)
    context = build_decode_context(lens, tables, 4, None)
    context.group_bytes = 4 * 2 * 4 * 16 * 4 * 3  # a few blocks a group: several groups
    assert len(context.plan(16).groups) > 1
    got = decode_attention(query, k_cache, v_cache, 0.5, context, sinks)
    expected = reference.paged_attention(query, k_cache, v_cache, tables, torch.arange(6, dtype=torch.int32), lens,
                                         0.5, None, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
