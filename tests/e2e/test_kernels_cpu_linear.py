"""The native linear layer (kernels/cpu_linear.c: float32 arithmetic on float32, bfloat16 or float16
weights) against its torch reference, F.linear in float64: every row count the register tiles
split into (6-row tiles and each tail of 1-5 rows), widths that end inside a 16-column panel, K
past one k-block, bias and strided rows; in every ISA variant this CPU can run (the x86-64-v3 build is what an AVX2 machine runs; without AVX2 the
kernel is absent and the worker keeps oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from support.cpu_variants import skip_where_linear_is_absent, variant  # noqa: F401 (a fixture)
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


def reference(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def assert_float32_sum(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """Within the worst-case bound of a float32 sum of k products in any order, k * eps * sum|x w|
    (+ one rounding of the bias): never flaky, and a product lost or taken twice (an error of
    order 1) is far outside it."""
    k = x.shape[1]
    expected = reference(x, weight, bias)
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (0 if bias is None else bias.double().abs())
    bound = (k + 1) * torch.finfo(torch.float32).eps * magnitude
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,n", [(1, 16), (17, 15), (64, 17), (896, 40), (1100, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_f_linear_within_float32_sums(variant, rows, k, n, with_bias):
    skip_where_linear_is_absent(variant)
    gen = torch.Generator().manual_seed(rows * 7919 + k * 31 + n)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(2 * rows, k, generator=gen)[::2]  # strided rows, as a view of a wider tensor can be
    panels = cpu_native.pack_linear_weight(weight)
    assert panels.shape == (-(-n // 16), k, 16)
    got = cpu_native.linear(x, panels, n, bias)
    assert got.shape == (rows, n)
    assert_float32_sum(got, x, weight, bias)
    assert torch.equal(got, cpu_native.linear(x.contiguous(), panels, n, bias))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 6, 13])
def test_half_precision_panels_give_the_bits_of_their_float32_copy(variant, half, rows):
    """Half-precision weights are widened exactly and summed in the same order: a bfloat16
    checkpoint computed in float32 gives the float32 path's bits from half the bytes."""
    if variant == "scalar":
        pytest.skip("no AVX2 and FMA: the kernel is absent in this variant")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 1100, generator=gen).to(half)
    x, bias = torch.randn(rows, 1100, generator=gen), torch.randn(40, generator=gen)
    narrow, wide = cpu_native.pack_linear_weight(weight), cpu_native.pack_linear_weight(weight.float())
    assert narrow.dtype == half and wide.dtype == torch.float32
    got = cpu_native.linear(x, narrow, 40, bias)
    assert torch.equal(got, cpu_native.linear(x, wide, 40, bias))
    assert_float32_sum(got, x, weight.float(), bias)


def test_the_padding_past_the_last_column_is_zero_and_never_written_out():
    weight = torch.randn(20, 8)
    panels = cpu_native.pack_linear_weight(weight)
    assert panels.shape == (2, 8, 16) and torch.equal(panels[1, :, 4:], torch.zeros(8, 12))
    assert torch.equal(panels.transpose(1, 2).reshape(32, 8)[:20], weight)
    if cpu_native.supports_linear():
        out = cpu_native.linear(torch.randn(3, 8), panels, 20)
        assert out.shape == (3, 20) and torch.isfinite(out).all()


@pytest.mark.skipif(not cpu_native.supports_linear(), reason="no AVX2 and FMA here: the kernel is absent")
def test_the_bits_do_not_depend_on_the_thread_count():
    """Each output column is one thread's, summed in one order whatever the thread count, so a
    step's logits (and greedy tokens) never change with --num-threads."""
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(1000, 896, generator=gen), torch.randn(37, 896, generator=gen)
    panels = cpu_native.pack_linear_weight(weight)
    outs = results_at_thread_counts(lambda: cpu_native.linear(x, panels, 1000))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(not cpu_native.supports_linear(), reason="no AVX2 and FMA here: the kernel is absent")
def test_a_mismatched_weight_is_an_error_not_a_wild_read():
    panels = cpu_native.pack_linear_weight(torch.randn(32, 64))
    with pytest.raises(ValueError):
        cpu_native.linear(torch.randn(4, 63), panels, 32)  # K differs
    with pytest.raises(ValueError):
        cpu_native.linear(torch.randn(4, 64), panels, 33)  # more columns than the panels hold
    with pytest.raises(ValueError):
        cpu_native.linear(torch.randn(4, 64, dtype=torch.float64), panels, 32)
