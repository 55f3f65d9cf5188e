"""kernels/cpu_gemm_w8a8.c as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py: native
is AVX512-VNNI's vpdpbusd here; x86-64-v4 and x86-64-v3 take the AVX2 vpmaddubsw path; x86-64 the scalar
loops): the int32 sums exact against torch's integer matmul at odd K and N and 1-300 rows, the scaled result
the reference's bits, a gate_up's SiLU gate the unfused path's (this CPU's own build, in process:
tests/unit/test_cpu_gemm_w8a8.py). Other levels run the compiler: slow."""

from __future__ import annotations

import pytest

from pagedserve.kernels import cpu_native, cpu_quantized
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.w8a8_checks import DTYPES, SIZES, check_int32_sums, check_reference_bits, check_silu_gate_bits

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

# what w8a8_variant() reports in each variant of cpu_kernel_variant() (AVX-512 without VNNI takes AVX2's path)
W8A8_VARIANTS = {"avx512": "avx2", "avx2": "avx2", "scalar": "scalar"}


@pytest.mark.parametrize("k,n", SIZES)
def test_every_variant_sums_exactly_in_int32(variant, k, n):  # noqa: F811
    assert cpu_quantized.w8a8_variant() == W8A8_VARIANTS.get(variant, "avx512vnni")
    check_int32_sums(k, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_gives_the_references_bits(variant, dtype):  # noqa: F811
    check_reference_bits(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_gates_a_gate_up_as_the_unfused_path(variant, dtype):  # noqa: F811
    check_silu_gate_bits(dtype)
