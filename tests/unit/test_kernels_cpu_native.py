"""The native CPU decode attention (kernels/cpu_decode_attention.c) against kernels.reference.paged_attention,
and how it is built: only into a private cache, and never in the way when it cannot be."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc.decode_attention import build_decode_context, decode_attention
from support.attention import nan_cache_with_requests

needs_library = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")


def stale_cache(seq_lens, block_size, kv_heads, head_dim, generator):
    """NaN everywhere but the slots the requests own, blocks scattered; tables padded with 0."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    return nan_cache_with_requests(seq_lens, kv_heads, generator, block_size, head_dim, num_blocks)


def native(query, k_cache, v_cache, tables, seq_lens, scale, window):
    context = build_decode_context(seq_lens, tables, k_cache.shape[1], window)
    return cpu_native.paged_decode_attention(query, k_cache, v_cache, context.native_tables(k_cache.shape[0]),
                                             context.first, context.last, scale)


@needs_library
@pytest.mark.parametrize("window", [None, 3, 50])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (7, 1), (4, 4), (14, 2)])
def test_decode_attention_equals_the_reference_and_never_reads_a_stale_slot(window, block_size, head_dim,
                                                                            q_heads, kv_heads):
    generator = torch.Generator().manual_seed(block_size * 1000 + head_dim * 10 + q_heads)
    seq_lens = [1, 2, block_size, block_size + 1, 61, 300]
    k_cache, v_cache, tables = stale_cache(seq_lens, block_size, kv_heads, head_dim, generator)
    query = torch.randn(len(seq_lens), q_heads, head_dim, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    expected = reference.paged_attention(query, k_cache, v_cache, tables,
                                         torch.arange(len(seq_lens) + 1, dtype=torch.int32), lens, scale, window)
    got = native(query, k_cache, v_cache, tables, lens, scale, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@needs_library
def test_threads_split_requests_so_the_answer_does_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(5)
    seq_lens = [int(n) for n in torch.randint(1, 400, (33,), generator=generator)]
    k_cache, v_cache, tables = stale_cache(seq_lens, 16, 2, 64, generator)
    query = torch.randn(len(seq_lens), 8, 64, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native(query, k_cache, v_cache, tables, lens, 0.125, None)
        torch.set_num_threads(2)
        two = native(query, k_cache, v_cache, tables, lens, 0.125, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_library
def test_a_block_id_outside_the_cache_is_an_error_not_a_wild_read():
    generator = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = stale_cache([5, 9], 4, 2, 8, generator)
    tables[1, 1] = k_cache.shape[0]  # one past the end, inside what request 1 reads
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(IndexError, match="outside the cache"):
        decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, 0.3,
                         build_decode_context(lens, tables, 4, None))
    tables[1, 1] = -1
    with pytest.raises(IndexError, match="outside the cache"):
        decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, 0.3,
                         build_decode_context(lens, tables, 4, None))


def test_other_dtypes_take_the_torch_path_with_the_same_answer():
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables = stale_cache([3, 17], 4, 2, 8, generator)
    k_cache, v_cache = k_cache.double(), v_cache.double()  # bfloat16 and float16 are native (test_kernels_cpu_half.py)
    query = torch.randn(2, 4, 8, generator=generator).double()
    lens = torch.tensor([3, 17], dtype=torch.int32)
    assert not cpu_native.supports_decode(query, k_cache)
    got = decode_attention(query, k_cache, v_cache, 0.3, build_decode_context(lens, tables, 4, None))
    expected = reference.paged_attention(query, k_cache, v_cache, tables, torch.arange(3, dtype=torch.int32),
                                         lens, 0.3, None)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_a_cache_directory_others_may_write_is_never_used(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert not cpu_native._private_dir(shared)
    assert cpu_native._private_dir(tmp_path / "fresh" / "kernels")
    assert (tmp_path / "fresh" / "kernels").stat().st_mode & 0o777 == 0o700


def test_no_compiler_means_the_torch_path_and_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
        assert cpu_native._build() is None
    assert "no C compiler" in caplog.text


def test_the_environment_can_turn_native_kernels_off(monkeypatch):
    monkeypatch.setenv(cpu_native.CPU_KERNELS_ENV, "torch")
    assert cpu_native._build() is None


@needs_library
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
@pytest.mark.parametrize("strided", [False, True])
def test_rotary_is_bit_for_bit_the_torch_path(monkeypatch, head_dim, strided):
    from types import SimpleNamespace

    from pagedserve.worker_proc.rotary import RotaryEmbedding

    generator = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0, rope_scaling=None), head_dim, 512,
                             torch.device("cpu"), torch.float32)
    qkv = torch.randn(300, 9 * head_dim, generator=generator)  # 6 q/k heads and 3 more, as a qkv row
    x = qkv[:, :6 * head_dim].view(300, 6, head_dim) if strided else qkv[:, :6 * head_dim].reshape(300, 6, head_dim)
    positions = torch.randint(0, 512, (300,), generator=generator)
    native_out = rotary(x, positions)
    monkeypatch.setattr(cpu_native, "supports_rotary", lambda *_: False)
    assert torch.equal(native_out, rotary(x, positions))


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_with_the_kv_write_equals_rotary_then_the_reference_write(dtype, tokens):
    """A decode layer's q/k rotation and its KV write in one native call: the rotated q and k bit for bit
    the rotary kernel's, and the cache afterwards what reference.write_kv leaves (padding slot -1 skipped)."""
    from types import SimpleNamespace

    from pagedserve.worker_proc.elementwise import NativeElementwise, TorchElementwise
    from pagedserve.worker_proc.rotary import RotaryEmbedding

    q_heads, kv_heads, dim = 6, 2, 64
    generator = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0, rope_scaling=None), dim, 512,
                             torch.device("cpu"), dtype)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    qk = qkv[:, :(q_heads + kv_heads) * dim].view(tokens, -1, dim)
    value = qkv[:, (q_heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 512, (tokens,), generator=generator)
    slots = torch.randperm(8 * 16, generator=generator)[:tokens]
    slots[-1] = -1 if tokens > 1 else slots[-1]
    results = []
    for ew in (NativeElementwise(), TorchElementwise()):
        k_cache, v_cache = (torch.randn(8, 16, kv_heads, dim, generator=torch.Generator().manual_seed(9)).to(dtype)
                            for _ in range(2))
        results.append((ew.rotary_write_kv(rotary, qk, positions, value, k_cache, v_cache, slots, reference),
                        k_cache, v_cache))
    (got, got_k, got_v), (want, want_k, want_v) = results
    assert cpu_native.supports_rotary_write_kv(qk, rotary.cos, value, got_k, got_v)  # the native call ran
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@needs_library
def test_a_slot_outside_the_cache_is_an_error_and_nothing_is_written():
    q_heads, kv_heads, dim = 2, 1, 16
    x = torch.randn(2, q_heads + kv_heads, dim, dtype=torch.bfloat16)
    value = torch.randn(2, kv_heads, dim, dtype=torch.bfloat16)
    table = torch.randn(8, dim // 2, dtype=torch.bfloat16)
    k_cache, v_cache = torch.zeros(2, 4, kv_heads, dim, dtype=torch.bfloat16), torch.zeros(2, 4, kv_heads, dim,
                                                                                          dtype=torch.bfloat16)
    for bad in (8, -2):
        with pytest.raises(IndexError, match="outside the cache"):
            cpu_native.rotary_write_kv(x, table, table, torch.tensor([0, 1]), value, k_cache, v_cache,
                                       torch.tensor([0, bad]))
    assert not k_cache.any() and not v_cache.any()


def test_a_position_outside_the_rotary_table_is_an_error_not_a_wild_read():
    from types import SimpleNamespace

    from pagedserve.worker_proc.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0, rope_scaling=None), 16, 64,
                             torch.device("cpu"), torch.float32)
    for bad in (64, -1):  # ModelRunner.execute checks each step's position range before the forward
        with pytest.raises(IndexError, match="rotary table"):
            rotary.check_positions(min(0, bad), max(5, bad))
    rotary.check_positions(0, 63)


def test_a_cached_file_that_is_no_library_means_the_torch_path(tmp_path, caplog):
    bogus = tmp_path / "cpu_kernels-bogus.so"
    bogus.write_bytes(b"not an ELF file")
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
        assert cpu_native._load(bogus) is None
    assert "did not load" in caplog.text
