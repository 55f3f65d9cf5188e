"""Multi-head latent attention (DeepSeek) against its expanded form: per-head keys and values made
from the cached latent by W_UK and W_UV, float64, as transformers computes them. Each path the
worker takes with absorbed queries (worker_proc/latent_attention.py) meets it on a NaN-poisoned
latent cache holding only the requests' rows, in a ragged step mixing decodes and prompt chunks
over cached context: the torch reference, every CPU path (absorbed decodes through the native
decode kernel or the gathered SDPA, expanded prompt chunks through SDPA) and the Triton MLA kernel
(interpreted on CPU, or on a GPU: support/kernel_device.py)."""

from support.kernel_device import MARKS, to_device  # first: it decides TRITON_INTERPRET before triton loads

import pytest
import torch

from pagedserve.kernels import cpu_native, reference, triton_ops
from pagedserve.worker_proc.attention import plan_cpu_attention
from pagedserve.worker_proc.latent_attention import latent_attention
from support.attention import nan_cache_with_requests

NOPE, V_DIM, BLOCK = 12, 10, 4


def expanded_attention_f64(q_nope, q_rope, cache, tables, starts, seq_lens, w_uk, w_uv, scale):
    """transformers' MLA: K = [c W_UK^T, k_rope] and V = c W_UV per head, causal softmax, in float64."""
    latent = w_uk.shape[2]
    out = torch.full((*q_nope.shape[:2], w_uv.shape[2]), float("nan"), dtype=torch.float64)
    for b, seq_len in enumerate(seq_lens.tolist()):
        first, end = starts[b].item(), starts[b + 1].item()
        rows = cache[tables[b, :-(-seq_len // BLOCK)].long()].reshape(-1, cache.shape[-1])[:seq_len].double()
        c, k_rope = rows[:, :latent], rows[:, latent:]
        keys = torch.cat([torch.einsum("sl,hdl->hsd", c, w_uk.double()),
                          k_rope.expand(w_uk.shape[0], -1, -1)], dim=-1)
        values = torch.einsum("sl,hlv->hsv", c, w_uv.double())
        q = torch.cat([q_nope[first:end], q_rope[first:end]], dim=-1).double().transpose(0, 1)
        scores = (q @ keys.transpose(1, 2)) * scale
        n = end - first
        scores.masked_fill_(~torch.ones(n, seq_len, dtype=torch.bool).tril(seq_len - n), float("-inf"))
        out[first:end] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def ragged_step(heads, latent, rope, generator, dtype=torch.float32):
    """Decodes (1 query over 1, 6, 33 keys) and prompt chunks (9 queries over 9; 5 over 23), the
    latent cache NaN outside the requests' slots, the step's own rows among them."""
    seq_lens, q_lens = [1, 6, 9, 33, 23], [1, 1, 9, 1, 5]
    cache, _, tables = nan_cache_with_requests(seq_lens, 1, generator, block_size=BLOCK, head_dim=latent + rope)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    tokens = starts[-1].item()
    q_nope = torch.randn(tokens, heads, NOPE, generator=generator)
    q_rope = torch.randn(tokens, heads, rope, generator=generator)
    w_uk = torch.randn(heads, NOPE, latent, generator=generator) / latent ** 0.5
    w_uv = torch.randn(heads, latent, V_DIM, generator=generator) / latent ** 0.5
    # the step's own rows: the last q_len of each request's latent rows
    flat = cache.view(-1, latent + rope)
    own = []
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        positions = torch.arange(s - n, s)
        own.append(flat[tables[b].long()[positions // BLOCK] * BLOCK + positions % BLOCK])
    rows = torch.cat(own)[:, None]
    cast = [t.to(dtype) for t in (q_nope, q_rope, rows, w_uk, w_uv, cache)]
    return (*cast, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), q_lens)


def expected(step, scale):
    q_nope, q_rope, _, w_uk, w_uv, cache, tables, starts, seq_lens, _ = step
    return expanded_attention_f64(q_nope, q_rope, cache.float(), tables, starts, seq_lens, w_uk.float(), w_uv.float(),
                                  scale)


@pytest.mark.parametrize("latent, rope", [(28, 4), (20, 4), (64, 32)])
def test_the_reference_with_absorbed_queries_equals_the_expanded_attention(latent, rope):
    generator = torch.Generator().manual_seed(latent)
    step = ragged_step(6, latent, rope, generator)
    q_nope, q_rope, _, w_uk, w_uv, cache, tables, starts, seq_lens, _ = step
    query = torch.cat([torch.einsum("thd,hdl->thl", q_nope, w_uk), q_rope], dim=-1)
    rows = reference.mla_attention(query, cache, tables, starts, seq_lens, 0.3, latent)
    assert rows.shape == (q_nope.shape[0], 6, latent)
    ours = torch.einsum("thl,hlv->thv", rows, w_uv)
    torch.testing.assert_close(ours.double(), expected(step, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("native", [True, False], ids=["native decode kernel", "SDPA decodes"])
@pytest.mark.parametrize("latent, rope", [(28, 4), (20, 4), (512, 64)])
def test_every_cpu_path_of_latent_attention_equals_the_expanded_attention(latent, rope, native, monkeypatch):
    """Decodes absorbed (the native kernel, or gathered SDPA), prompt chunks expanded (SDPA), in one
    step; (512, 64): DeepSeek-V3's own latent."""
    if not native:
        monkeypatch.setattr(cpu_native, "supports_decode", lambda *a: False)
    calls = []
    kernel = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda *a, **kw: calls.append(a) or kernel(*a, **kw))
    generator = torch.Generator().manual_seed(latent + rope)
    heads = 16 if latent == 512 else 6
    step = ragged_step(heads, latent, rope, generator)
    q_nope, q_rope, rows, w_uk, w_uv, cache, tables, starts, seq_lens, q_lens = step
    plan = plan_cpu_attention(q_lens, starts.tolist(), seq_lens.tolist(), tables, BLOCK)
    ours = latent_attention(reference, q_nope, q_rope, rows, w_uk, w_uv.contiguous(), cache, tables, starts,
                            seq_lens, 0.3, plan)
    torch.testing.assert_close(ours.double(), expected(step, 0.3), rtol=1e-4, atol=1e-4)
    assert len(calls) == (1 if native else 0)
    # a step of decodes only: the absorbed form alone
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    rows_of = starts[decodes]
    sub = (q_nope[rows_of], q_rope[rows_of], rows[rows_of], w_uk, w_uv, cache, tables[decodes],
           torch.arange(len(decodes) + 1), seq_lens[decodes], [1] * len(decodes))
    plan = plan_cpu_attention(sub[-1], sub[7].tolist(), sub[8].tolist(), sub[6], BLOCK)
    ours = latent_attention(reference, *sub[:5], cache, sub[6], sub[7], sub[8], 0.3, plan)
    torch.testing.assert_close(ours.double(), expected(sub, 0.3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, latent, rope", [(6, 28, 4), (20, 20, 4), (16, 64, 32), (16, 512, 64)])
def test_the_triton_mla_kernel_equals_the_expanded_attention(heads, latent, rope, dtype):
    """20 heads: a block of 16 and a partial one; widths that are not powers of two; (512, 64):
    DeepSeek-V3's latent, 16 heads (one rank of eight)."""
    for mark in MARKS:  # slow and GPU marks where PAGEDSERVE_TEST_DEVICE=cuda (support/kernel_device.py)
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    generator = torch.Generator().manual_seed(heads + latent)
    step = ragged_step(heads, latent, rope, generator, dtype)
    q_nope, q_rope, rows, w_uk, w_uv, cache, tables, starts, seq_lens, _ = step
    query = torch.cat([torch.einsum("thd,hdl->thl", q_nope.float(), w_uk.float()).to(dtype), q_rope], dim=-1)
    device_query, device_cache = to_device(query, cache)
    out = triton_ops.mla_attention(device_query, device_cache, tables, starts, seq_lens, 0.3, latent).cpu()
    assert out.dtype == dtype and out.shape == (query.shape[0], heads, latent) and out.isfinite().all()
    ours = torch.einsum("thl,hlv->thv", out.double(), w_uv.double())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours, expected(step, 0.3), rtol=tolerance, atol=tolerance)
    absorbed = reference.mla_attention(query, cache, tables, starts, seq_lens, 0.3, latent)
    torch.testing.assert_close(out.float(), absorbed.float(), rtol=tolerance, atol=tolerance)
