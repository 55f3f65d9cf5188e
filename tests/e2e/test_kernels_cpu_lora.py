"""kernels/cpu_lora.c as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py: the x86-64-v4
build is an AVX-512 CPU without AVX512-BF16, bfloat16 widened; x86-64-v3 an AVX2 machine's; x86-64 the generic
vectors), against the exact product in float64 at 1..300 tokens mixing slots and the base model, decodes and
prompt chunks (this CPU's own build, in process, at more sizes: tests/unit/test_cpu_lora.py). Other levels run
the compiler: slow."""

from __future__ import annotations

import pytest

from pagedserve.kernels import cpu_native
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.lora_kernel_checks import DTYPES, SHAPES, check_lora_kernel, token_slots

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("runs", [False, True], ids=["spread", "runs"])
@pytest.mark.parametrize("tokens", [1, 5, 65, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_adds_each_tokens_own_slots_delta(variant, dtype, tokens, runs):
    for i, (k, outs, r_max) in enumerate(SHAPES):
        check_lora_kernel(token_slots(tokens, runs, seed=tokens + i), k, outs, r_max, dtype, seed=i)
