"""The gated MLP's input in one native call (kernels/cpu_linear.c silu_gate: silu(x @ gate.T) *
(x @ up.T) from a gate_up weight whose panels alternate gate and up) against its torch reference:
linear()'s own gate and up products, then SiLU and the product in float64. Every row tail,
widths that end inside a panel, K past one k-block, biases, half-precision panels; in every ISA
variant this CPU can run. And through the model's path (models/linear.py silu_gate), against
linear() followed by transformers' SiLU gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.elementwise import TorchElementwise
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout, linear, silu_gate
from support.cpu_variants import skip_where_linear_is_absent, variant  # noqa: F401 (a fixture)
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")
NATIVE = WeightLayout(plain=False, native=True)


def assert_silu_gate(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, size: int, bias) -> None:
    """Within 8 float32 rounding steps of SiLU and the product taken exactly from linear()'s
    gate and up (the exp is a polynomial within 2 ulp; a gate paired with another column's up,
    or up taken as the gate, is off by far more)."""
    gate_up = cpu_native.linear(x, cpu_native.pack_linear_weight(weight), 2 * size, bias).double()
    expected = F.silu(gate_up[:, :size]) * gate_up[:, size:]
    assert got.shape == (x.shape[0], size) and got.dtype == torch.float32 and got.is_contiguous()
    bound = 8 * torch.finfo(torch.float32).eps * expected.abs() + 1e-30
    assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,size", [(17, 15), (64, 17), (896, 40), (1100, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_gate_is_silu_of_the_gate_times_up(variant, rows, k, size, with_bias):
    skip_where_linear_is_absent(variant)
    gen = torch.Generator().manual_seed(rows * 7919 + k * 31 + size)
    weight = torch.randn(2 * size, k, generator=gen) / k**0.5 * 3  # gates well past the knee of SiLU
    bias = torch.randn(2 * size, generator=gen) if with_bias else None
    x = torch.randn(2 * rows, k, generator=gen)[::2]  # strided rows
    panels = cpu_native.pack_silu_gate_weight(weight, size)
    assert panels.shape == (2 * -(-size // 16), k, 16)
    got = cpu_native.silu_gate(x, panels, size, bias)
    assert_silu_gate(got, x, weight, size, bias)
    assert torch.equal(got, cpu_native.silu_gate(x.contiguous(), panels, size, bias))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_panels_give_the_bits_of_their_float32_copy(half):
    if not cpu_native.supports_linear():
        pytest.skip("no AVX2 and FMA here: the kernel is absent")
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(80, 300, generator=gen).to(half), torch.randn(9, 300, generator=gen)
    narrow = cpu_native.silu_gate(x, cpu_native.pack_silu_gate_weight(weight, 40), 40)
    assert torch.equal(narrow, cpu_native.silu_gate(x, cpu_native.pack_silu_gate_weight(weight.float(), 40), 40))


@pytest.mark.skipif(not cpu_native.supports_linear(), reason="no AVX2 and FMA here: the kernel is absent")
def test_the_bits_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(2 * 500, 896, generator=gen), torch.randn(37, 896, generator=gen)
    panels = cpu_native.pack_silu_gate_weight(weight, 500)
    outs = results_at_thread_counts(lambda: cpu_native.silu_gate(x, panels, 500))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(not cpu_native.supports_linear(), reason="no AVX2 and FMA here: the kernel is absent")
def test_a_mismatched_weight_is_an_error_not_a_wild_read():
    panels = cpu_native.pack_silu_gate_weight(torch.randn(64, 32), 32)
    with pytest.raises(ValueError):
        cpu_native.silu_gate(torch.randn(4, 31), panels, 32)  # K differs
    with pytest.raises(ValueError):
        cpu_native.silu_gate(torch.randn(4, 32), panels, 40)  # wider than the panels hold


@pytest.mark.skipif(not cpu_native.supports_linear(), reason="no AVX2 and FMA here: the kernel is absent")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_the_models_gate_up_takes_the_fused_call(dtype, rows):
    """A native layout packs gate_up for silu_gate, which then gives what linear() and
    transformers' SiLU gate give, within a rounding step of the dtype; the packed weight is
    refused by linear() itself (its columns alternate gate and up)."""
    gen = torch.Generator().manual_seed(rows)
    weight, x = (torch.randn(2 * 48, 64, generator=gen) / 4).to(dtype), torch.randn(rows, 64, generator=gen).to(dtype)
    fused, plain = LinearWeight.of(weight, None, NATIVE, gate_size=48), LinearWeight.of(weight, None, NATIVE)
    assert fused.gate_size == 48
    got = silu_gate(x, fused, TorchElementwise())
    expected = TorchElementwise().silu_mul(linear(x, plain), 48)
    assert got.dtype == dtype and got.shape == (rows, 48)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    with pytest.raises(ValueError):
        linear(x, fused)
