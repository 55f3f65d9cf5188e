"""Checks of kernels/cpu_gemv.c against F.linear in float64, shared by the in-process test of this
CPU's build (tests/unit/test_cpu_gemv.py) and the one over every x86-64 level's build
(tests/e2e/test_kernels_cpu_gemv.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# K and N around the vector widths (16 float32 or 32 bfloat16 a 512-bit vector, 8 float32 on AVX2) and the
# row blocks (up to 8 rows of W), odd ones included, and the 0.5B's K (896, 4864).
SIZES = ((1, 1), (7, 3), (31, 9), (33, 17), (64, 8), (95, 13), (896, 40), (4864, 11))


def check_gemv(rows: int, k: int, n: int, dtype: torch.dtype, with_bias: bool, out_dtype=None) -> None:
    """gemv(x, W, b) within the float32 sum's worst-case bound of the exact product, k * eps * sum|x w|
    (vdpbf16ps flushes subnormal products: none here), then rounded once to ``out_dtype``: half an
    ulp of the result more. Strided x rows give the same bits as contiguous ones."""
    gen = torch.Generator().manual_seed(rows * 7919 + k * 31 + n)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(2 * rows, k, generator=gen).to(dtype)[::2]
    got = cpu_native.gemv(x, weight, bias, out_dtype=out_dtype)
    out_dtype = out_dtype or dtype
    assert got.shape == (rows, n) and got.dtype == out_dtype and got.is_contiguous()
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (0 if bias is None else bias.double().abs())
    bound = (k + 2) * torch.finfo(torch.float32).eps * magnitude
    if out_dtype != torch.float32:  # one rounding to the output's dtype: half an ulp of it, relative
        bound = bound * (1 + torch.finfo(out_dtype).eps) + (exact.abs() + bound) * torch.finfo(out_dtype).eps / 2
        bound = bound + torch.finfo(out_dtype).tiny  # a subnormal result
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"worst error {error.max().item():.3g}"
    assert torch.equal(got, cpu_native.gemv(x.contiguous(), weight, bias, out_dtype=out_dtype))
