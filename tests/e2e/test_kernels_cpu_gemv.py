"""kernels/cpu_gemv.c as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py: the
x86-64-v4 build is an AVX-512 CPU without AVX512-BF16, bfloat16 widened; x86-64-v3 an AVX2 machine's;
x86-64 the generic vectors), against F.linear in float64 at 1-8 rows with odd K and N (this CPU's own
build, in process: tests/unit/test_cpu_gemv.py). Other levels run the compiler: slow."""

from __future__ import annotations

import pytest

from pagedserve.kernels import cpu_native
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.gemv_checks import DTYPES, SIZES, check_gemv

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

# what gemv_variant() reports in each variant of cpu_kernel_variant()
GEMV_VARIANTS = {"avx512bf16": "avx512bf16", "avx512": "avx512", "avx2": "avx2", "scalar": "scalar"}


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_is_f_linear_within_float32_sums(variant, rows, k, n, dtype):
    assert cpu_native.gemv_variant() == GEMV_VARIANTS[variant]
    check_gemv(rows, k, n, dtype, with_bias=(rows + n) % 2 == 1)
