"""The CPU matmul layouts of worker_proc/models/linear.py: which one a model gets, and that
every one of them computes x @ W.T + b (greedy parity through them: test_model_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.worker_proc.models import linear as lin

CPU = torch.device("cpu")
MIB = 1 << 20


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


LAYOUTS = {
    "resident_copy": lin.WeightLayout(transposed=True, resident=True),
    "resident_copy_and_packed": lin.WeightLayout(transposed=True, resident=True, packed=True),
    "streamed_copy": lin.WeightLayout(transposed=True),
    "packed_and_plain": lin.WeightLayout(packed=True),
    "packed_only": lin.WeightLayout(packed=True, plain=False),
    "plain_only": lin.WeightLayout(),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_layout_computes_x_times_w_transposed_plus_bias(layout, rows, with_bias):
    if LAYOUTS[layout].packed and not lin.packed_linear_available(torch.float32):
        pytest.skip("torch built without oneDNN")
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
