"""The CPU matmul layouts of worker_proc/models/linear.py: which one a model gets, and that
every one of them computes x @ W.T + b (greedy parity through them: test_model_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.models import linear as lin

CPU = torch.device("cpu")
MIB = 1 << 20
NATIVE = pytest.mark.skipif(not cpu_native.supports_linear(), reason="no native linear kernel here (it needs AVX2 "
                            "and FMA, and a C compiler)")


@pytest.fixture(autouse=True)
def onednn_unless_native_asked(monkeypatch):
    """The oneDNN and oneMKL rules below are the ones a CPU with AVX-512 gets; the native kernels'
    tests ask for them."""
    monkeypatch.setenv(lin.NATIVE_ENV, "0")
    monkeypatch.setenv(lin.GEMV_ENV, "0")


@pytest.mark.skipif(not lin.packed_linear_available(torch.float32), reason="torch built without oneDNN")
@pytest.mark.parametrize("env,weight_bytes,expected", [
    ("", 8 * MIB, lin.WeightLayout(transposed=True, resident=True)),
    ("1", 8 * MIB, lin.WeightLayout(transposed=True, resident=True, packed=True)),
    ("", 100 * MIB, lin.WeightLayout(packed=True)),
    ("0", 100 * MIB, lin.WeightLayout(transposed=True)),
    ("", 2048 * MIB, lin.WeightLayout(packed=True, plain=False)),
    ("0", 2048 * MIB, lin.WeightLayout()),
])
def test_each_model_size_gets_its_layout(monkeypatch, env, weight_bytes, expected):
    monkeypatch.setenv(lin.PACKED_ENV, env)
    assert lin.weight_layout(CPU, weight_bytes) == expected


@NATIVE
@pytest.mark.parametrize("env,flags,dtype,chosen", [
    ("", {"avx2", "fma"}, torch.float32, True),
    ("", {"avx2", "fma", "avx512f"}, torch.float32, False),  # oneDNN's 512-bit vectors, unmeasured against it
    ("1", {"avx2", "fma", "avx512f"}, torch.float32, True),
    ("0", {"avx2", "fma"}, torch.float32, False),
    ("", {"avx2", "fma"}, torch.bfloat16, True),  # torch's bfloat16 matmuls are 2-6x slower there than these
    ("1", {"avx2", "fma"}, torch.float16, True),
    ("", {"avx2", "fma"}, torch.float64, False),
])
def test_the_native_kernel_serves_cpus_without_avx512(monkeypatch, env, flags, dtype, chosen):
    monkeypatch.setenv(lin.NATIVE_ENV, env)
    monkeypatch.setattr(lin, "cpu_flags", lambda: frozenset(flags))
    for weight_bytes in (8 * MIB, 100 * MIB, 2048 * MIB):
        layout = lin.weight_layout(CPU, weight_bytes, dtype)
        assert layout.native == chosen
        if chosen:  # the panels alone, and a cache-resident model's [in, out] copy for one row
            assert not layout.plain and not layout.packed and layout.transposed == (weight_bytes <= 16 * MIB)
    assert not lin.weight_layout(torch.device("meta"), 100 * MIB).native


@NATIVE
@pytest.mark.parametrize("values,kept", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                         (torch.float32, torch.float32)])
def test_a_half_precision_checkpoint_computed_in_float32_keeps_half_the_bytes(values, kept):
    """Its weights widen exactly, so the products are float32's from half the bytes."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=gen).to(values).float()
    w = lin.LinearWeight.of(weight, None, lin.WeightLayout(plain=False, native=True))
    assert w.panels.dtype == kept and w.weight is None
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(lin.linear(x, w).double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-5)


def test_without_the_kernel_float32_keeps_onednn(monkeypatch):
    monkeypatch.setenv(lin.NATIVE_ENV, "1")
    monkeypatch.setattr(cpu_native, "supports_linear", lambda: False)  # no compiler, or no AVX2
    packed = lin.packed_linear_available(torch.float32)
    assert lin.weight_layout(CPU, 100 * MIB) == lin.WeightLayout(packed=packed, transposed=not packed)


def test_packing_needs_float32_or_onednns_bfloat16_on_cpu(monkeypatch):
    monkeypatch.setenv(lin.PACKED_ENV, "1")
    assert not lin.weight_layout(CPU, 100 * MIB, torch.float16).packed
    monkeypatch.setattr(lin, "_onednn_bfloat16", lambda: False)  # an AVX2 CPU
    assert not lin.weight_layout(CPU, 100 * MIB, torch.bfloat16).packed
    assert lin.weight_layout(torch.device("meta"), 100 * MIB) == lin.WeightLayout()


BF16_PACKED = pytest.mark.skipif(not lin.packed_linear_available(torch.bfloat16),
                                 reason="no oneDNN bfloat16 on this CPU (it needs AVX-512)")


@BF16_PACKED
@pytest.mark.parametrize("weight_bytes", [8 * MIB, 100 * MIB, 2048 * MIB])
def test_bfloat16_keeps_only_the_packed_weight_at_every_size(monkeypatch, weight_bytes):
    monkeypatch.setenv(lin.PACKED_ENV, "")
    assert lin.weight_layout(CPU, weight_bytes, torch.bfloat16) == lin.WeightLayout(packed=True, plain=False)
    monkeypatch.setenv(lin.PACKED_ENV, "0")  # the unpacked paths, as before packing in bfloat16
    assert not lin.weight_layout(CPU, weight_bytes, torch.bfloat16).packed


@BF16_PACKED
@pytest.mark.parametrize("rows", [1, 2, 32, 256])
def test_bfloat16_rows_of_every_count_take_the_packed_weight(monkeypatch, rows):
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise

    class Spy:  # torch.ops namespaces refuse setattr of one op; swap the namespace instead
        _linear_pointwise = staticmethod(lambda *a: calls.append(a[0].shape[0]) or pointwise(*a))

    w = lin.LinearWeight.of(torch.randn(48, 32, dtype=torch.bfloat16), None,
                            lin.weight_layout(CPU, 100 * MIB, torch.bfloat16))
    monkeypatch.setattr(torch.ops, "mkldnn", Spy)
    assert lin.linear(torch.randn(rows, 32, dtype=torch.bfloat16), w).shape == (rows, 48)
    assert calls == [rows]


GEMV_BF16 = pytest.mark.skipif(cpu_native.gemv_variant() != "avx512bf16",
                               reason="cpu_gemv.c is chosen by default only with AVX512-BF16 (vdpbf16ps)")


@GEMV_BF16
@pytest.mark.parametrize("weight_bytes", [100 * MIB, 2048 * MIB, 8192 * MIB])
def test_bfloat16_on_avx512_bf16_keeps_the_weight_for_few_rows_and_packs_it_beside_where_that_fits(
        monkeypatch, weight_bytes):
    monkeypatch.setenv(lin.GEMV_ENV, "")
    packed = lin.packed_linear_available(torch.bfloat16)
    layout = lin.weight_layout(CPU, weight_bytes, torch.bfloat16)
    if weight_bytes > lin.GEMV_TWO_LAYOUTS_MAX_BYTES and packed:  # one copy: panels beside it would be two
        assert layout == lin.WeightLayout(packed=True, plain=False)
        w = lin.LinearWeight.of(torch.randn(48, 32, dtype=torch.bfloat16), None, layout)
        assert w.gemv_panels is None and w.weight is None and w.packed is not None
        return
    # the panels (made in LinearWeight.of) take 1-4 rows, the packed copy the rest; without it the weight as loaded
    assert layout == lin.WeightLayout(packed=packed, plain=not packed, gemv=True)
    assert not lin.weight_layout(CPU, weight_bytes, torch.float32).gemv  # measured faster in bfloat16 only
    monkeypatch.setenv(lin.GEMV_ENV, "1")
    assert lin.weight_layout(CPU, weight_bytes, torch.float32).gemv
    monkeypatch.setenv(lin.GEMV_ENV, "0")
    assert not lin.weight_layout(CPU, weight_bytes, torch.bfloat16).gemv


@GEMV_BF16
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 32])
@pytest.mark.parametrize("weight_bytes", [100 * MIB, 8192 * MIB])
def test_bfloat16_rows_up_to_four_take_the_gemv_panels_and_more_the_packed_weight(monkeypatch, rows, weight_bytes):
    """A model past GEMV_TWO_LAYOUTS_MAX_BYTES keeps oneDNN's packed weight alone, which takes every row count
    (without oneDNN's bfloat16 it keeps the weight as loaded, and 5-8 rows take the row-major GEMV)."""
    monkeypatch.setenv(lin.GEMV_ENV, "")
    calls = []
    for name in ("gemv", "gemv_panels"):
        kernel = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda x, *a, _k=kernel, _n=name: calls.append(_n) or _k(x, *a))
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    w = lin.LinearWeight.of(weight, None, lin.weight_layout(CPU, weight_bytes, torch.bfloat16))
    out = lin.linear(torch.randn(rows, 32, dtype=torch.bfloat16), w)
    assert out.shape == (rows, 48)
    packed = w.packed is not None
    expected = ([] if not w.gemv else ["gemv_panels"] if rows <= lin.GEMV_PANEL_MAX_ROWS else
                ["gemv"] if rows <= lin.GEMV_MAX_ROWS and not packed else [])
    assert w.gemv == (weight_bytes <= lin.GEMV_TWO_LAYOUTS_MAX_BYTES or not lin.packed_linear_available(torch.bfloat16))
    assert calls == expected


LAYOUTS = {
    "resident_copy": lin.WeightLayout(transposed=True, resident=True),
    "resident_copy_and_packed": lin.WeightLayout(transposed=True, resident=True, packed=True),
    "streamed_copy": lin.WeightLayout(transposed=True),
    "packed_and_plain": lin.WeightLayout(packed=True),
    "packed_only": lin.WeightLayout(packed=True, plain=False),
    "plain_only": lin.WeightLayout(),
    "native": lin.WeightLayout(plain=False, native=True),
    "native_and_resident_copy": lin.WeightLayout(transposed=True, resident=True, plain=False, native=True),
    "gemv_and_packed": lin.WeightLayout(packed=True, gemv=True),
    "gemv_panels_and_packed": lin.WeightLayout(packed=True, plain=False, gemv=True),
    "gemv_only": lin.WeightLayout(gemv=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_layout_computes_x_times_w_transposed_plus_bias(layout, rows, with_bias):
    if LAYOUTS[layout].packed and not lin.packed_linear_available(torch.float32):
        pytest.skip("torch built without oneDNN")
    if LAYOUTS[layout].native and not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here")
    if LAYOUTS[layout].gemv and cpu_native.library() is None:
        pytest.skip("no native CPU kernels here")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    w = lin.LinearWeight.of(weight, bias, LAYOUTS[layout])
    x = torch.randn(2 * rows, 64, generator=gen)[::2]  # strided rows, as a gathered view can be
    out = lin.linear(x, w)
    expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    assert out.shape == (rows, 96) and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, lin.linear(x.contiguous(), w))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 2, 5, 40, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_layout_in_bfloat16_computes_what_f_linear_does_within_its_rounding(layout, rows, with_bias):
    if LAYOUTS[layout].packed and not lin.packed_linear_available(torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this CPU (it needs AVX-512)")
    if LAYOUTS[layout].native and not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here")
    if LAYOUTS[layout].gemv and cpu_native.library() is None:
        pytest.skip("no native CPU kernels here")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    w = lin.LinearWeight.of(weight, bias, LAYOUTS[layout])
    x = torch.randn(2 * rows, 64, generator=gen).bfloat16()[::2]
    out = lin.linear(x, w)
    assert out.shape == (rows, 96) and out.is_contiguous() and out.dtype == torch.bfloat16
    # Each path sums in float32 and rounds once (bias added before or after that rounding):
    # within two bfloat16 steps of the result (2**-7 relative), plus a little for sums near 0.
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), rtol=2 ** -7, atol=0.05)
    assert torch.equal(out, lin.linear(x.contiguous(), w))


def test_a_torch_without_onednn_keeps_onemkl_layouts(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not lin._packed_linear_works.__wrapped__()
    monkeypatch.setattr(lin, "_packed_linear_works", lambda dtype=None: False)
    monkeypatch.setenv(lin.PACKED_ENV, "1")
    assert lin.weight_layout(CPU, 100 * MIB) == lin.WeightLayout(transposed=True)
    assert lin.weight_layout(CPU, 100 * MIB, torch.bfloat16) == lin.WeightLayout(transposed=True)


def test_a_misspelt_switch_is_refused_not_ignored(monkeypatch):
    monkeypatch.setenv(lin.PACKED_ENV, "yes")
    with pytest.raises(ValueError, match=lin.PACKED_ENV):
        lin.weight_layout(CPU, 100 * MIB)
