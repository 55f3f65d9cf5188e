"""The native CPU kernels in bfloat16 and float16 (kernels/cpu_*_half.c, cpu_half.h), and the float32
decode attention, against their torch references: decode and prefill attention within a rounding
step of the dtype of a float32 (or float64) reference, rotary bit for bit the torch ops. Each runs
in every ISA variant this CPU can execute: the library built for lower x86-64 levels gives the AVX2
and scalar code that other machines run. A bfloat16 model's forward through the native kernels
equals the torch path's within bfloat16's tolerance."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc.attention import attend, plan_cpu_attention
from pagedserve.worker_proc.decode_attention import build_decode_context, decode_attention
from pagedserve.worker_proc.rotary import RotaryEmbedding
from support.attention import causal_attention_f64, qkv_rows
from support.attention import nan_cache_with_requests
from support.cpu_variants import variant  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

HALF = [torch.bfloat16, torch.float16]
# A forward's logits, native kernels against the torch path (measured 0: the attention outputs
# round to the same bfloat16 but for a few); a third of test_model_parity's bound against transformers.
BF16_STEP_LOGIT_TOLERANCE = 0.05


def assert_within_a_rounding_step(got, expected, dtype):
    """got (dtype) equals expected (a wider reference) rounded, give or take one step of the
    dtype; atol covers float32's own sums of values near zero."""
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.to(expected.dtype), expected, rtol=torch.finfo(dtype).eps, atol=1e-5)


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (7, 1), (4, 4), (14, 2)])
def test_decode_attention_is_the_reference_rounded_and_never_reads_a_stale_slot(variant, dtype, head_dim, q_heads,
                                                                                 kv_heads):
    """Windows shorter and longer than a block, block sizes 1 and 16, blocks scattered and NaN
    in every slot a request does not own. float32 too: its values pass differs by ISA (a head's
    row in registers on AVX-512, a value row per KV head on AVX2, the plain loop otherwise)."""
    for block_size in (1, 16):
        generator = torch.Generator().manual_seed(block_size * 1000 + head_dim * 10 + q_heads)
        seq_lens = [1, 2, block_size, block_size + 1, 61, 300]
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
        k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, kv_heads, generator, block_size, head_dim,
                                                           num_blocks)
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        query = torch.randn(len(seq_lens), q_heads, head_dim, generator=generator).to(dtype)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        for window in (None, 3, 50):
            expected = reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), tables,
                                                 torch.arange(len(seq_lens) + 1, dtype=torch.int32), lens,
                                                 head_dim ** -0.5, window)
            context = build_decode_context(lens, tables, block_size, window)
            assert cpu_native.supports_decode(query, k_cache)
            got = decode_attention(query, k_cache, v_cache, head_dim ** -0.5, context)
            assert_within_a_rounding_step(got, expected, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_half_decode_gives_the_same_bits_on_any_thread_count(dtype):
    generator = torch.Generator().manual_seed(5)
    seq_lens = [int(n) for n in torch.randint(1, 400, (33,), generator=generator)]
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 3
    k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, 2, generator, 16, 64, num_blocks)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    query = torch.randn(len(seq_lens), 14, 64, generator=generator).to(dtype)
    context = build_decode_context(torch.tensor(seq_lens, dtype=torch.int32), tables, 16, None)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(decode_attention(query, k_cache, v_cache, 0.125, context))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
@pytest.mark.parametrize("q_heads,kv_heads", [(14, 2), (8, 8), (6, 1)])
def test_one_request_split_by_kv_head_over_the_threads_gives_its_bits_in_a_batch(dtype, q_heads, kv_heads):
    """A batch smaller than the threads (one stream) is shared out by KV head; each request alone, at 2 threads and
    at 1, with and without sinks, equals its row of a batch that takes one request a thread."""
    generator = torch.Generator().manual_seed(q_heads + kv_heads)
    seq_lens = [1, 17, 130, 311]
    num_blocks = sum(-(-n // 16) for n in seq_lens) + 3
    k_cache, v_cache, tables = nan_cache_with_requests(seq_lens, kv_heads, generator, 16, 64, num_blocks)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    query = torch.randn(len(seq_lens), q_heads, 64, generator=generator).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        for sinks in (None, torch.randn(q_heads, generator=generator)):
            torch.set_num_threads(2)
            batch = decode_attention(query, k_cache, v_cache, 0.125, build_decode_context(lens, tables, 16, None), sinks)
            for n in (2, 1):
                torch.set_num_threads(n)
                for b in range(len(seq_lens)):
                    alone = decode_attention(query[b:b + 1], k_cache, v_cache, 0.125,
                                             build_decode_context(lens[b:b + 1], tables[b:b + 1], 16, None), sinks)
                    assert torch.equal(alone[0], batch[b])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(7, 1), (4, 4), (14, 2)])
def test_prefill_chunks_on_their_own_keys_and_after_context_are_the_reference_rounded(variant, dtype, head_dim,
                                                                                     q_heads, kv_heads):
    generator = torch.Generator().manual_seed(head_dim + q_heads)
    first, length = [0, 1, 9, 43, 76, 109], [1, 8, 31, 33, 33, 200]  # rows 40..42 and the last 5 are no chunk's
    total = first[-1] + length[-1] + 5
    query, key, value = (t.to(dtype) for t in qkv_rows(total, q_heads, kv_heads, head_dim, generator))
    out = torch.full((total, q_heads, head_dim), float("nan"), dtype=dtype)
    assert cpu_native.supports_prefill(query, key)
    cpu_native.prefill_attention(query, key, value, out, torch.tensor(first), torch.tensor(length), 0.2)
    expected = causal_attention_f64(query, key, value, first, length, 0.2)
    chunk_rows = torch.cat([torch.arange(f, f + n) for f, n in zip(first, length)])
    assert out.isnan().sum() == (total - len(chunk_rows)) * q_heads * head_dim  # no other row written
    assert_within_a_rounding_step(out[chunk_rows], expected[chunk_rows], dtype)

    first, length, context, key_first = [0, 5, 45], [5, 40, 9], [300, 7, 0], [0, 305, 352]
    _, key, value = (t.to(dtype) for t in qkv_rows(361, q_heads, kv_heads, head_dim, generator))
    out = torch.full((total, q_heads, head_dim), float("nan"), dtype=dtype)
    cpu_native.prefill_attention(query, key, value, out, torch.tensor(first), torch.tensor(length), 0.2,
                                 torch.tensor(key_first), torch.tensor(context))
    expected = causal_attention_f64(query, key, value, first, length, 0.2, key_first, context)
    assert_within_a_rounding_step(out[:54], expected[:54], dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("sliding_window", [None, 5, 300])
def test_a_mixed_half_step_takes_the_native_kernels_and_matches_the_reference(dtype, sliding_window, monkeypatch):
    """Decodes, fresh prompts and a chunk after a cached prefix in one step, through attend."""
    calls = []
    kernel = cpu_native.prefill_attention
    monkeypatch.setattr(cpu_native, "prefill_attention", lambda *a: calls.append(a[4].tolist()) or kernel(*a))
    generator = torch.Generator().manual_seed(11)
    head_dim, q_heads, kv_heads, block_size = 64, 14, 2, 4
    num_scheduled, seq_lens = [1, 19, 3, 1, 13], [9, 19, 12, 30, 13]
    k_cache, v_cache, block_tables = nan_cache_with_requests(seq_lens, kv_heads, generator, block_size=block_size,
                                                             head_dim=head_dim)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    starts = [0]
    for n in num_scheduled:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], q_heads, head_dim, generator=generator).to(dtype)
    key = torch.empty(starts[-1], kv_heads, head_dim, dtype=dtype)  # this step's rows, as written to the cache
    value = torch.empty_like(key)
    for b, (n, seq_len) in enumerate(zip(num_scheduled, seq_lens)):
        for i, pos in enumerate(range(seq_len - n, seq_len)):
            slot = (int(block_tables[b, pos // block_size]), pos % block_size)
            key[starts[b] + i], value[starts[b] + i] = k_cache[slot], v_cache[slot]
    args = (block_tables, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 0.3,
            sliding_window)
    plan = plan_cpu_attention(num_scheduled, starts, seq_lens, block_tables, block_size)
    got = attend(reference, query, key, value, k_cache, v_cache, *args, plan)
    expected = reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), *args)
    assert_within_a_rounding_step(got, expected, dtype)
    assert calls == {None: [[1, 24], [20]], 5: [], 300: [[1, 24], [20]]}[sliding_window]  # first rows


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", [8, 32, 64, 80, 128])
@pytest.mark.parametrize("strided", [False, True])
def test_half_rotary_is_bit_for_bit_the_torch_ops_in_that_dtype(variant, monkeypatch, dtype, head_dim, strided):
    generator = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0, rope_scaling=None), head_dim, 4096,
                             torch.device("cpu"), dtype)
    qkv = (torch.randn(300, 9 * head_dim, generator=generator) * 4).to(dtype)  # 6 q/k heads and 3 more
    x = qkv[:, :6 * head_dim].view(300, 6, head_dim) if strided else qkv[:, :6 * head_dim].reshape(300, 6, head_dim)
    positions = torch.randint(0, 4096, (300,), generator=generator)
    assert cpu_native.supports_rotary(x, rotary.cos)
    native_out = rotary(x, positions)
    assert native_out.dtype == dtype
    assert torch.equal(native_out, rotary.torch_rotate(x, positions))


def test_the_variant_is_named_and_matches_what_the_cpu_has():
    flags = cpu_native._cpu_flags().split()
    expected = ("avx512bf16" if "avx512_bf16" in flags and "avx512f" in flags
                else "avx512" if "avx512f" in flags
                else "avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "scalar")
    assert cpu_native.kernel_variant() == expected


def _bf16_run(model_dir) -> tuple[list[torch.Tensor], dict]:
    """Each step's logits and the greedy tokens of three prompts: one prefilled in chunks after
    its cached prefix, all arriving at different steps so prefills and decodes share steps."""
    from pagedserve.worker_proc.model_runner import ModelRunner
    from support.worker_harness import TrivialScheduler, random_prompts

    runner = ModelRunner(str(model_dir), dtype="bfloat16")
    logits, compute_logits = [], runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: logits.append(compute_logits(hidden).float()) or logits[-1]
    scheduler = TrivialScheduler(runner, block_size=16)
    for i, (prompt, chunks) in enumerate(zip(random_prompts([70, 9, 40], vocab_size=512), ([32], [], [16, 8]))):
        scheduler.add(f"r{i}", prompt, 6, prefill_chunks=list(chunks), arrival_step=2 * i)
    return logits, scheduler.run()


def test_a_bfloat16_forward_through_the_native_kernels_equals_the_torch_path(tmp_path, monkeypatch):
    from pagedserve.tools.demo_model import build_model_dir

    model_dir = build_model_dir(tmp_path / "m", "qwen2", hidden_size=256, num_heads=4, num_kv_heads=2,
                                intermediate_size=256, dtype="bfloat16")  # head_dim 64: every native kernel
    calls = {}
    for name in ("paged_decode_attention", "prefill_attention", "rotary_write_kv"):  # rotary with the KV write
        kernel = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _k=kernel, _n=name: calls.update({_n: 1}) or _k(*a))
    native_logits, native_tokens = _bf16_run(model_dir)
    assert sorted(calls) == ["paged_decode_attention", "prefill_attention", "rotary_write_kv"]
    for name in ("supports_decode", "supports_prefill", "supports_rotary", "supports_rotary_write_kv"):
        monkeypatch.setattr(cpu_native, name, lambda *_: False)
    torch_logits, torch_tokens = _bf16_run(model_dir)
    assert len(native_logits) == len(torch_logits) == 11
    # Steps up to the first whose greedy tokens differ (if any) saw the same inputs in both runs;
    # the first six hold the chunked prefills, the prefix hit and the decodes beside them.
    same_inputs = next((i for i, (ours, theirs) in enumerate(zip(native_logits, torch_logits))
                        if not torch.equal(ours.argmax(-1), theirs.argmax(-1))), len(native_logits) - 1)
    assert same_inputs >= 6
    for ours, theirs in zip(native_logits[:same_inputs + 1], torch_logits):
        assert (ours - theirs).abs().max() < BF16_STEP_LOGIT_TOLERANCE
