"""kernels/cpu_gemv_int8.c (int8 weights in blocks with a float32 scale each: GGUF's Q8_0 and
compressed-tensors' int8 groups) as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py;
this CPU's own build needs no compiler run, the other levels are slow), against its torch reference in
float64 (the dequantized weight q * scale, as the layer holds it) within float32 sums, at 1-8 rows
and more, 8 at a time; the
bits whatever the thread count; refusals that keep its reads in bounds. Its Q8_0 x Q8_0 form (gemv_q8_0,
llama.cpp's arithmetic: x quantized per block of 32 too) against quantized_linear.q8_0_reference the same way,
and exact where the sums are integers; its forms on the rows in tiles of 8 (gemv_q8_0_tiles) and on 5-bit values
(gemv_q5_0) equal to it bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.models import quantized_linear as ql
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

# (inputs, outputs, block): Q8_0's 32 over a 0.5B's shapes and odd row counts (the last rows of a
# block of R), compressed-tensors' 128
SHAPES = [(896, 2 * 896 + 256, 32), (4864, 37, 32), (96, 1, 32), (256, 61, 128), (64, 9, 16)]


def _blocks(n: int, k: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return q, torch.rand(n, k // block, generator=gen) * 0.02 + 1e-4


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T in float64, the float32 sums' bound): W = q * scale rounded to float32 once, the layer's weight."""
    n, k = q.shape
    w = (q.float().view(n, k // block, block) * scales.unsqueeze(-1)).view(n, k).double()
    xd = x.double()
    return xd @ w.t(), k * 2.0**-23 * (xd.abs() @ w.abs().t())


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 19])  # 19: three passes of up to 8
@pytest.mark.parametrize("k,n,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_variant_is_the_dequantized_weights_product_within_float32_sums(variant, rows, k, n, block, dtype):
    q, scales = _blocks(n, k, block, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    want, bound = reference(x, q, scales, block)
    got = cpu_quantized.gemv_int8_blocks(x, q, scales, block, out_dtype=torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()
    rounded = cpu_quantized.gemv_int8_blocks(x, q, scales, block)  # x's dtype: the float32 result rounded once
    assert rounded.dtype == dtype and torch.equal(rounded, got.to(dtype))


def test_the_bits_do_not_depend_on_the_thread_count():
    q, scales = _blocks(1000, 896, 32, seed=1)
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = results_at_thread_counts(lambda: cpu_quantized.gemv_int8_blocks(x, q, scales, 32))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_mismatched_inputs_are_an_error_not_a_wild_read():
    q, scales = _blocks(32, 64, 32, seed=3)
    x = torch.randn(4, 64).bfloat16()
    for args in ((torch.randn(4, 63).bfloat16(), q, scales, 32),  # K differs
                 (torch.randn(0, 64).bfloat16(), q, scales, 32),  # no rows
                 (x, q.float(), scales, 32),  # not int8
                 (x, q, scales[:, :1], 32),  # one scale a row where the blocks need two
                 (x, q, scales, 24)):  # a block the vectors do not tile
        with pytest.raises(ValueError):
            cpu_quantized.gemv_int8_blocks(*args)


# ---------------------------------------------------------------- Q8_0 x Q8_0 (gemv_q8_0)

# (inputs, outputs): an odd count of blocks (one 512-bit vector holds two), a single block, the 0.5B's shapes
Q8_0_SHAPES = [(896, 2 * 896 + 256), (4864, 37), (96, 1), (32, 9), (160, 61)]


def _q8_0_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float16 scales (a GGUF Q8_0 file's)."""
    q, scales = _blocks(n, k, 32, seed)
    return q, scales.half()


def _q8_0_bound(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 sums' bound: k roundings of at most 2^-23 of the sum of the terms' magnitudes."""
    n, k = q.shape
    xq, dx = ql.quantize_per_block(x)
    mags = torch.einsum("mbt,nbt->mnb", xq.view(-1, k // 32, 32).abs().double(), q.view(n, k // 32, 32).abs().double())
    return k * 2.0**-23 * (mags * scales.double().view(1, n, -1) * dx.double().unsqueeze(1)).sum(-1)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 19])
@pytest.mark.parametrize("k,n", Q8_0_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_q8_0_is_llamacpps_arithmetic_within_float32_sums_on_every_variant(variant, rows, k, n, dtype):
    q, scales = _q8_0_blocks(n, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0, :32] = 0  # a zero block: d = 0, its products 0
    want = ql.q8_0_reference(q, scales, x)
    got = cpu_quantized.gemv_q8_0(x, q, scales, out_dtype=torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= _q8_0_bound(x, q, scales)).all()
    rounded = cpu_quantized.gemv_q8_0(x, q, scales)  # x's dtype: the float32 result rounded once
    assert rounded.dtype == dtype and torch.equal(rounded, got.to(dtype))


@pytest.mark.parametrize("k", [96, 896])
def test_q8_0_sums_of_integers_are_exact_on_every_variant(variant, k):
    """Each block of x holding 127 (d = 1, x its own int8 values) and unit weight scales: the output is the int8
    products' sum, exactly (every partial sum is an integer below 2^24)."""
    gen = torch.Generator().manual_seed(k)
    q = torch.randint(-128, 128, (45, k), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (3, k), generator=gen).float()
    x.view(3, k // 32, 32)[..., 5] = 127.0
    got = cpu_quantized.gemv_q8_0(x.bfloat16(), q, torch.ones(45, k // 32, dtype=torch.float16), out_dtype=torch.float32)
    assert torch.equal(got, (x.to(torch.int64) @ q.to(torch.int64).t()).float())


def test_q8_0_variant_is_named_and_its_bits_do_not_depend_on_the_thread_count():
    assert cpu_quantized.q8_0_variant() == ("avx512vnni" if {"avx512_vnni", "avx512bw"} <= set(cpu_native._cpu_flags().split())
                                         else "portable")
    q, scales = _q8_0_blocks(1000, 896, seed=1)
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = results_at_thread_counts(lambda: cpu_quantized.gemv_q8_0(x, q, scales))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_q8_0_refuses_mismatched_inputs():
    q, scales = _q8_0_blocks(32, 64, seed=3)
    x = torch.randn(4, 64).bfloat16()
    for args in ((torch.randn(4, 63).bfloat16(), q, scales),  # K differs
                 (torch.randn(0, 64).bfloat16(), q, scales),  # no rows
                 (x.to(torch.int32), q, scales),  # x not float
                 (x, q.float(), scales),  # not int8
                 (x, q, scales[:, :1]),  # one scale a row where the blocks need two
                 (x, q, scales.float())):  # Q8_0's scales are float16
        with pytest.raises(ValueError):
            cpu_quantized.gemv_q8_0(*args)



# ---------------------------------------------------------------- Q8_0 in tiles, Q5_0 x Q8_0: the same sums

@pytest.mark.parametrize("rows", [1, 3, 8, 19])
@pytest.mark.parametrize("k,n", [(896, 2 * 896 + 256), (4864, 37), (64, 1), (128, 9)])
def test_q8_0_in_tiles_gives_the_row_major_outputs_bit_for_bit_on_every_variant(variant, rows, k, n):
    q, scales = _q8_0_blocks(n, k, seed=rows + k)
    tiled = cpu_quantized.pack_q8_0_tiles(q)
    assert tiled.shape == (-(-n // 8) * 8, k) and torch.equal(cpu_quantized.unpack_q8_0_tiles(tiled, n), q)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    assert torch.equal(cpu_quantized.gemv_q8_0_tiles(x, tiled, scales), cpu_quantized.gemv_q8_0(x, q, scales))
    with pytest.raises(ValueError):
        cpu_quantized.gemv_q8_0_tiles(x, q[:, :k] if n % 8 else tiled[:, :64], scales)  # rows or inputs short


Q5_0_SHAPES = [(896, 2 * 896 + 256), (4864, 37), (64, 1), (128, 9)]  # inputs whole runs of 64


def _q5_0_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q5_0 matrix's values (-16..15) and float16 scales."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8)
    return q, (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half()


def test_q5_0_packing_keeps_every_value_in_fewer_bytes():
    q, _ = _q5_0_blocks(7, 192, seed=4)
    q[0, :64] = torch.arange(-16, 16, dtype=torch.int8).repeat(2)  # every value, in both halves of a run
    packed = cpu_quantized.pack_q5_0(q)
    assert packed.shape == (8, 192 // 64 * 40) and packed.dtype == torch.uint8  # rows in tiles of 8
    assert torch.equal(cpu_quantized.unpack_q5_0(packed, 7), q)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 19])
@pytest.mark.parametrize("k,n", Q5_0_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_q5_0_gives_q8_0s_outputs_on_the_same_values_on_every_variant(variant, rows, k, n, dtype):
    """llama.cpp's Q5_0 x Q8_0: within float32 sums of the reference, and bit for bit gemv_q8_0's on the unpacked
    values (the same exact block sums, scaled and summed in the same order)."""
    q, scales = _q5_0_blocks(n, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0, :32] = 0  # a zero block: d = 0, its products 0
    packed = cpu_quantized.pack_q5_0(q)
    got = cpu_quantized.gemv_q5_0(x, packed, scales, out_dtype=torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert ((got.double() - ql.q8_0_reference(q, scales, x)).abs() <= _q8_0_bound(x, q, scales)).all()
    assert torch.equal(got, cpu_quantized.gemv_q8_0(x, q, scales, out_dtype=torch.float32))
    assert torch.equal(cpu_quantized.gemv_q5_0(x, packed, scales), got.to(dtype))


def test_q5_0_bits_do_not_depend_on_the_thread_count():
    q, scales = _q5_0_blocks(1000, 896, seed=5)
    packed = cpu_quantized.pack_q5_0(q)
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(6)).bfloat16()
    outs = results_at_thread_counts(lambda: cpu_quantized.gemv_q5_0(x, packed, scales))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_q5_0_refuses_mismatched_inputs():
    q, scales = _q5_0_blocks(32, 128, seed=7)
    packed = cpu_quantized.pack_q5_0(q)
    x = torch.randn(4, 128).bfloat16()
    for args in ((torch.randn(4, 64).bfloat16(), packed, scales),  # K differs
                 (torch.randn(0, 128).bfloat16(), packed, scales),  # no rows
                 (x, q, scales),  # not packed
                 (x, packed[:, :40], scales),  # a row's bytes short
                 (x, packed[:24], scales),  # rows short
                 (x, packed, scales.float())):  # Q5_0's scales are float16
        with pytest.raises(ValueError):
            cpu_quantized.gemv_q5_0(*args)
    with pytest.raises(ValueError):
        cpu_quantized.pack_q5_0(q[:, :96])  # not whole runs of 64
