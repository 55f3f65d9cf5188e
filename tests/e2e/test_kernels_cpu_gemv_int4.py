"""kernels/cpu_gemv_int4.c (int4 weights in groups of a multiple of 32 with a float32 scale each, symmetric,
with a zero point, or less a float min: GGUF's Q4_0, compressed-tensors' W4A16, GGUF's Q4_K) as built for every x86-64 level this CPU runs
(tests/support/cpu_variants.py; this CPU's own build needs no compiler run, the other levels are slow),
against its torch reference in float64 (the dequantized weight (nibble - z) * scale) within float32 sums,
at 1-8 rows and more, 8 at a time; the bits whatever the thread count; refusals that keep its reads in bounds.
bfloat16 x on the avx512bf16 variant multiplies by vdpbf16ps, each nibble u as the bfloat16 1 + u / 128: the
products are exact (x is not rounded: it is bfloat16 already), the sums float32, so the same bound holds with
the terms it sums, |x| (128 + u) and (128 + z) |x| a weight (times the scale), in place of |x| u and z |x|."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

# (inputs, outputs, group, asymmetric): Q4_0's 32 over a 0.5B's shapes and odd row counts (the last rows of a
# block of R), compressed-tensors' 128 both ways, a per-channel weight (one group spanning the row)
SHAPES = [(896, 2 * 896 + 256, 32, False), (4864, 37, 32, False), (96, 1, 32, False), (256, 61, 128, False),
          (384, 9, 128, True), (224, 13, 224, True),
          # groups of 64 and 96 (the vdpbf16ps form's 128-input steps span 2 groups, or parts of two), and K = 896
          # g128 asymmetric (the 0.5B's projections with zero points)
          (640, 11, 64, True), (480, 21, 96, False), (896, 33, 128, True)]


def _groups(n: int, k: int, group: int, asym: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                         Optional[torch.Tensor]]:
    """(nibbles [n, k] uint8, scales [n, k / group] float32, zeros: None or 8 + a zero point in [-8, 7])."""
    gen = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-4
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float() if asym else None
    return nibbles, scales, zeros


def reference(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
              group: int, bias: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T in float64, the float32 sums' bound). W = (nibble - z) * scale; the kernel sums (bias + nibble)
    * x per group and takes (bias + z) * (the group's sum of x) off, so its roundings scale with |x| . (nibble +
    z + 2 bias) * scale: bias 0 for the float32 forms, 128 for vdpbf16ps (its words are 1 + nibble / 128)."""
    n, k = nibbles.shape
    z = torch.full_like(scales, 8.0) if zeros is None else zeros
    u = nibbles.double().view(n, k // group, group)
    w = ((u - z.double().unsqueeze(-1)) * scales.double().unsqueeze(-1)).view(n, k)
    w_abs = ((u + z.double().unsqueeze(-1) + 2 * bias) * scales.double().unsqueeze(-1)).view(n, k)
    xd = x.double()
    return xd @ w.t(), 2 * k * 2.0**-23 * (xd.abs() @ w_abs.t())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 19])  # each row count's own blocks; 19: three passes
@pytest.mark.parametrize("k,n,group,asym", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_variant_is_the_dequantized_weights_product_within_float32_sums(variant, rows, k, n, group, asym,
                                                                              dtype):
    nibbles, scales, zeros = _groups(n, k, group, asym, seed=rows + k)
    packed = cpu_quantized.pack_int4_blocks(nibbles)
    assert packed.shape == (n, k // 2) and torch.equal(cpu_quantized.unpack_int4_blocks(packed), nibbles)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert cpu_quantized.gemv_int4_variant() == variant  # the instructions this build multiplies with
    by_dpbf16 = variant == "avx512bf16" and dtype == torch.bfloat16
    want, bound = reference(x, nibbles, scales, zeros, group, bias=128.0 if by_dpbf16 else 0.0)
    got = cpu_quantized.gemv_int4_blocks(x, packed, scales, zeros, group, out_dtype=torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()
    rounded = cpu_quantized.gemv_int4_blocks(x, packed, scales, zeros, group)  # x's dtype: rounded once
    assert rounded.dtype == dtype and torch.equal(rounded, got.to(dtype))


# (inputs, outputs): Q4_K's groups of 32 with a float offset each, over a 0.5B's down_proj (4864 inputs) and odd row counts
MIN_SHAPES = [(4864, 37), (256, 61), (512, 9)]


def _groups_with_mins(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles, scales, mins) of Q4_K's form W = scale * nibble - min, min no multiple of the scale; one group of
    each row with scale 0 (a Q4_K sub-block whose 6-bit scale is 0: every weight is -min)."""
    gen = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.02
    scales[:, 1] = 0.0
    mins = torch.rand(n, k // 32, generator=gen) * 0.15
    return nibbles, scales, mins


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 19])
@pytest.mark.parametrize("k,n", MIN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_with_a_min_per_group_every_variant_is_scale_times_nibble_less_the_min(variant, rows, k, n, dtype):
    nibbles, scales, mins = _groups_with_mins(n, k, seed=rows + k)
    packed = cpu_quantized.pack_int4_blocks(nibbles)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    bias = 128.0 if variant == "avx512bf16" and dtype == torch.bfloat16 else 0.0
    u = nibbles.double().view(n, k // 32, 32)
    s, m = scales.double().unsqueeze(-1), mins.double().unsqueeze(-1)
    w, w_abs = (u * s - m).view(n, k), ((u + 2 * bias) * s + m).view(n, k)
    xd = x.double()
    want, bound = xd @ w.t(), 2 * k * 2.0**-23 * (xd.abs() @ w_abs.t())
    got = cpu_quantized.gemv_int4_blocks(x, packed, scales, None, 32, out_dtype=torch.float32, mins=mins)
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(cpu_quantized.gemv_int4_blocks(x, packed, scales, None, 32, mins=mins), got.to(dtype))


def test_q4_0s_payload_is_the_layout():
    """A GGUF Q4_0 block's 16 payload bytes (first 16 values low, next 16 high) are pack_int4_blocks' bytes."""
    import gguf
    import numpy as np

    weight = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(3, 2, 18)
    payload = torch.from_numpy(np.ascontiguousarray(raw[..., 2:])).reshape(3, 32)
    assert torch.equal(cpu_quantized.pack_int4_blocks(cpu_quantized.unpack_int4_blocks(payload)), payload)
    scales = torch.from_numpy(np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].astype(np.float32))
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(3, 36), gguf.GGMLQuantizationType.Q4_0))
    x = torch.eye(64)[:8]  # the first 8 inputs' weights, exactly
    assert torch.equal(cpu_quantized.gemv_int4_blocks(x, payload, scales, None, 32), want[:, :8].t())


def test_the_bits_do_not_depend_on_the_thread_count():
    nibbles, scales, zeros = _groups(1000, 896, 128, True, seed=1)
    packed = cpu_quantized.pack_int4_blocks(nibbles)
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = results_at_thread_counts(lambda: cpu_quantized.gemv_int4_blocks(x, packed, scales, zeros, 128))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_mismatched_inputs_are_an_error_not_a_wild_read():
    nibbles, scales, zeros = _groups(32, 128, 32, True, seed=3)
    packed = cpu_quantized.pack_int4_blocks(nibbles)
    x = torch.randn(4, 128).bfloat16()
    for args in ((torch.randn(4, 96).bfloat16(), packed, scales, None, 32),  # K differs
                 (torch.randn(0, 128).bfloat16(), packed, scales, None, 32),  # no rows
                 (x, packed.to(torch.int8), scales, None, 32),  # not uint8
                 (x, packed, scales[:, :2], None, 32),  # two scales a row where the groups need four
                 (x, packed, scales, zeros[:, :1], 32),  # one zero a row
                 (x, packed, scales, zeros, 32, None, None, zeros),  # zero points and mins both
                 (x, packed, scales, None, 48),  # a group the 32-input runs do not tile
                 (x, packed, scales, None, 0)):
        with pytest.raises(ValueError):
            cpu_quantized.gemv_int4_blocks(*args)
