"""kernels/cpu_gemm_w8a8.c, this CPU's build (every x86-64 level's: tests/e2e/test_kernels_cpu_gemm_w8a8.py):
each row of x quantized per token on entry as quantize_per_token does it and the int8 products summed exactly
in int32, equal to torch's int64 matmul of the same integers at odd K and N and 1-300 rows; the scaled result
the layer's plain-torch reference, bit for bit, in every dtype; a gate_up's SiLU gate in the epilogue the
unfused path's bits; the bits the same at any thread count; the refusals that keep its reads in bounds."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.models.quantized_linear import make_w8a8
from support.thread_counts import results_at_thread_counts
from support.w8a8_checks import (DTYPES, SIZES, check_int32_sums, check_reference_bits, check_silu_gate_bits,
                                 random_weight)

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("k,n", SIZES)
def test_int32_sums_equal_torch_integer_matmul_of_the_same_quantized_rows(k, n):
    check_int32_sums(k, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_result_is_the_references_bits(dtype):
    check_reference_bits(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_gate_up_gives_silu_gate_times_up_from_its_epilogue(dtype):
    check_silu_gate_bits(dtype)


def test_a_gate_that_fills_no_whole_panel_keeps_the_unfused_layout():
    q, scale = random_weight(2 * 40, 64, 6)
    layer = make_w8a8(q, scale.reshape(-1, 1), gate_size=40)
    assert layer.gate_size == 0
    x = torch.randn(3, 64)
    assert torch.equal(layer.forward(x), make_w8a8(q, scale.reshape(-1, 1)).forward(x))
    packed, sums = cpu_quantized.pack_w8a8_weight(q[:64], gate_size=32)
    with pytest.raises(ValueError):  # the panels hold a gate of 32, not 48
        cpu_quantized.w8a8_silu_gate(x, packed, sums, scale[:96], 48)


def test_a_given_row_max_scales_the_rows_as_the_whole_rows_would():
    """A tensor-parallel rank's x is a slice of each row: scaled by the whole row's max |x| (x_absmax), the
    product is the reference's at that scale; given the slice's own max, it is the default's bits."""
    q, scale = random_weight(48, 96, 7)
    layer = make_w8a8(q, scale.reshape(-1, 1))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(7))
    own = x.abs().amax(-1).contiguous()
    assert torch.equal(cpu_quantized.w8a8_linear(x, layer.weight, layer.w8a8_sums, layer.scales, 48, x_absmax=own),
                       layer.forward(x))
    whole = own * 3
    row_scale = (whole / 127).reshape(-1, 1)
    xq = torch.round(x / row_scale).clamp(-128, 127)
    expected = ((xq.long() @ q.long().t()).float() * row_scale * scale.reshape(1, -1))
    got = cpu_quantized.w8a8_linear(x, layer.weight, layer.w8a8_sums, layer.scales, 48, x_absmax=whole)
    assert torch.equal(got, expected)


def test_strided_rows_are_read_in_place():
    q, scale = random_weight(80, 96, 2)
    panels, sums = cpu_quantized.pack_w8a8_weight(q)
    x = torch.randn(5, 200, dtype=torch.bfloat16)[:, 10:106]
    assert torch.equal(cpu_quantized.w8a8_linear(x, panels, sums, scale, 80),
                       cpu_quantized.w8a8_linear(x.contiguous(), panels, sums, scale, 80))


def test_the_bits_do_not_depend_on_the_thread_count():
    q, scale = random_weight(1024, 896, 3)
    panels, sums = cpu_quantized.pack_w8a8_weight(q)
    gated = make_w8a8(q, scale.reshape(-1, 1), gate_size=512)
    x = torch.randn(40, 896, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for product in (lambda: cpu_quantized.w8a8_linear(x, panels, sums, scale, 1024), lambda: gated.silu_gate(x)):
        outs = results_at_thread_counts(product)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_the_variant_names_the_instructions_this_cpu_gives_it():
    flags = set(cpu_native._cpu_flags().split())
    expected = "avx512vnni" if {"avx512_vnni", "avx512bw"} <= flags else "avx2" if "avx2" in flags else "scalar"
    assert cpu_quantized.w8a8_variant() == expected


def test_mismatched_inputs_are_an_error_not_a_wild_read():
    q, scale = random_weight(32, 64, 4)
    panels, sums = cpu_quantized.pack_w8a8_weight(q)
    for x, n, s in ((torch.randn(4, 60), 32, scale),  # fewer 4-input steps than the panels
                    (torch.randn(0, 64), 32, scale),  # no rows
                    (torch.randn(4, 64), 48, torch.rand(48)),  # more columns than the panels hold
                    (torch.randn(4, 64), 32, scale.double())):
        with pytest.raises(ValueError):
            cpu_quantized.w8a8_linear(x, panels, sums, s, n)


def test_without_the_kernels_the_layer_runs_torch_int_mm_to_the_same_bits(monkeypatch):
    """Where the library does not build (no compiler, PAGEDSERVE_CPU_KERNELS=torch), make_w8a8 keeps the
    weight for torch._int_mm and quantizes x in torch: the same integers, the same result."""
    from pagedserve.worker_proc.models import quantized_linear as ql

    q, scale = random_weight(129, 259, 5)
    native = ql.make_w8a8(q, scale.reshape(-1, 1))
    monkeypatch.setattr(ql, "w8a8_kernel", lambda: False)
    fallback = ql.make_w8a8(q, scale.reshape(-1, 1))
    assert fallback.w8a8_sums is None and native.w8a8_sums is not None
    x = (torch.randn(33, 259, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    assert torch.equal(native.forward(x), fallback.forward(x))
