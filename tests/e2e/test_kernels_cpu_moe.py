"""kernels/cpu_moe.c as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py: the x86-64-v4
build is an AVX-512 CPU without AVX512-BF16, bfloat16 pairs widened to float32; x86-64-v3 an AVX2 machine's;
x86-64 the generic vectors), against the torch reference at decode's and prefill's row counts, with gpt-oss's
biases and clamped SwiGLU, experts no token routes to and one expert holding every token (this CPU's own build,
in process, at more sizes: tests/unit/test_cpu_moe.py). Other levels run the compiler: slow."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_moe, cpu_native
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.moe_kernel_checks import check_native_experts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 3, 9, 40])
@pytest.mark.parametrize("shape", [(8, 2, 64, 48), (6, 3, 33, 20), (8, 2, 1024, 384)], ids=str)
def test_every_variant_gives_the_references_outputs(variant, shape, tokens, gpt_oss):
    num_experts, top_k, hidden, size = shape
    # the worker takes it by default where it multiplies by vdpbf16ps; the widened forms are checked all the same
    assert cpu_moe.supports_native_experts() == (variant == "avx512bf16")
    check_native_experts(tokens, num_experts, top_k, hidden, size, seed=tokens, gpt_oss=gpt_oss, unused=(5,))
    check_native_experts(tokens, num_experts, 1, hidden, size, seed=tokens, ids=torch.full((tokens, 1), 3))
