"""kernels/cpu_gemv_int8.c (int8 weights in blocks with a float32 scale each: compressed-tensors' int8 groups,
GGUF's Q6_K; and float8_e4m3fn weights, FP8 checkpoints') as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py;
this CPU's own build needs no compiler run, the other levels are slow), against its torch reference in
float64 (the dequantized weight q * scale, as the layer holds it) within float32 sums, at 1-8 rows
and more, 8 at a time; the
bits whatever the thread count; refusals that keep its reads in bounds. (GGUF Q8_0 and Q5_0 layers multiply in
panels: test_kernels_cpu_gemm_q8_0.py.)"""

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


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_every_variant_multiplies_float8_weights_as_their_dequantized_values(variant, rows):
    """The same kernel on float8_e4m3fn bytes (an FP8 checkpoint, models/fp8_linear.py), subnormals and both
    signs of zero among them: within float32 sums of the float32 weight value * scale; and the dequantized copy
    for many rows (kernels/cpu_dequantize.c) is that weight bit for bit."""
    n, k = 37, 896
    gen = torch.Generator().manual_seed(rows)
    values = torch.randn(n, k, generator=gen) * 60
    values[0] = torch.linspace(-0.03, 0.03, k)  # float8's subnormals (below 2^-6), 0 and -0
    q = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, 1, generator=gen) * 0.001 + 1e-4
    x = torch.randn(rows, k, generator=gen).bfloat16()
    want, bound = reference(x, q.float(), scale, k)
    got = cpu_quantized.gemv_int8_blocks(x, q, cpu_quantized.fp8_block_scales(scale), k, out_dtype=torch.float32)
    assert ((got.double() - want).abs() <= bound).all()
    dequantized = cpu_quantized.dequantize("fp8_blocks", q, cpu_quantized.fp8_block_scales(scale), n, k, k,
                                           torch.float32)
    assert torch.equal(dequantized, q.float() * scale)


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
