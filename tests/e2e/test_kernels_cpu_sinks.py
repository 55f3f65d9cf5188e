"""The native decode kernels' attention sinks as built for each x86-64 level this CPU runs (AVX-512,
AVX2, scalar): each against the torch reference (tests/unit/test_kernels_attention_sinks.py)."""

from __future__ import annotations

import pytest

from support.cpu_variants import variant  # noqa: F401  (a fixture)
from unit.test_kernels_attention_sinks import test_native_decode_with_sinks_equals_the_reference as check

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("window", [None, 5])
def test_native_decode_with_sinks_equals_the_reference_on_each_isa(variant, window):
    for head_dim, q_heads, kv_heads in [(64, 8, 2), (40, 7, 1)]:
        check(window, head_dim, q_heads, kv_heads)
