"""kernels/cpu_gemv.c, this CPU's build (the decode step's few-row products; the build for each x86-64 level:
tests/e2e/test_kernels_cpu_gemv.py): against F.linear in float64 at 1-8 rows, every dtype, odd K and N,
bias, strided rows, each output dtype; the bits whatever the thread count; and the refusals that keep
its reads in bounds."""

from __future__ import annotations

import pytest
import torch

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
