"""kernels/cpu_gemv.c, this CPU's build (the decode step's few-row products; the build for each x86-64 level:
tests/e2e/test_kernels_cpu_gemv.py): against F.linear in float64 at 1-8 rows, every dtype, odd K and N,
bias, strided rows, each output dtype; the bits whatever the thread count; and the refusals that keep
its reads in bounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from support.gemv_checks import DTYPES, SIZES, check_gemv
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("k,n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_is_f_linear_within_float32_sums(rows, k, n, dtype):
    check_gemv(rows, k, n, dtype, with_bias=(rows + k) % 2 == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, None], ids=["float32 out", "its own dtype out"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_gemv_with_bias_into_either_output_dtype(dtype, out_dtype, rows):
    check_gemv(rows, 95, 37, dtype, with_bias=True, out_dtype=out_dtype)


def test_the_variant_names_the_instructions_this_cpu_gives_it():
    flags = cpu_native._cpu_flags().split()
    expected = ("avx512bf16" if {"avx512_bf16", "avx512bw"} <= set(flags) else "avx512" if "avx512f" in flags
                else "avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "scalar")
    assert cpu_native.gemv_variant() == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_bits_do_not_depend_on_the_thread_count(dtype):
    """Each output is one thread's row block, summed in one order whatever the thread count."""
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(1000, 896, generator=gen).to(dtype), torch.randn(3, 896, generator=gen).to(dtype)
    outs = results_at_thread_counts(lambda: cpu_native.gemv(x, weight))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_mismatched_inputs_are_an_error_not_a_wild_read():
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    for x, bias in ((torch.randn(4, 63, dtype=torch.bfloat16), None),  # K differs
                    (torch.randn(9, 64, dtype=torch.bfloat16), None),  # more rows than the kernel takes
                    (torch.randn(0, 64, dtype=torch.bfloat16), None),
                    (torch.randn(4, 64), None),  # another dtype than the weight's
                    (torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(31, dtype=torch.bfloat16))):
        with pytest.raises(ValueError):
            cpu_native.gemv(x, weight, bias)


PANELS = pytest.mark.skipif(cpu_native.library() is None or not cpu_native.supports_gemv_panels(),
                            reason="the bfloat16 panels run on vdpbf16ps: this CPU has no AVX512-BF16")


@PANELS
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("k,n", SIZES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemv_panels_are_f_linear_within_float32_sums(rows, k, n, out_dtype):
    """The panels' products against F.linear in float64 (odd K pads x with a zero; N past the last panel)."""
    gen = torch.Generator().manual_seed(rows * 7919 + k * 31 + n)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if (rows + k) % 2 else None
    x = torch.randn(2 * rows, k, generator=gen).bfloat16()[::2]
    panels = cpu_native.pack_gemv_panels(weight)
    assert panels.shape == (-(-n // 16), -(-k // 2), 16, 2)
    got = cpu_native.gemv_panels(x, panels, n, bias, out_dtype=out_dtype)
    assert got.shape == (rows, n) and got.dtype == out_dtype
    wide = cpu_native.gemv_panels(x, panels, n, bias, out_dtype=torch.float32)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (0 if bias is None else bias.double().abs())
    assert ((wide.double() - exact).abs() <= (k + 2) * torch.finfo(torch.float32).eps * magnitude).all()
    if out_dtype == torch.bfloat16:  # rounded once from the float32 result
        assert torch.equal(got, wide.bfloat16())
    assert torch.equal(got, cpu_native.gemv_panels(x.contiguous(), panels, n, bias, out_dtype=out_dtype))


@PANELS
def test_gemv_panels_refuse_what_they_do_not_hold():
    panels = cpu_native.pack_gemv_panels(torch.randn(32, 64).bfloat16())
    for x, n in ((torch.randn(2, 62).bfloat16(), 32), (torch.randn(2, 64).bfloat16(), 33),
                 (torch.randn(9, 64).bfloat16(), 32), (torch.randn(2, 64), 32)):
        with pytest.raises(ValueError):
            cpu_native.gemv_panels(x, panels, n)
