"""kernels/cpu_gemm_q8_0.c (GGUF Q8_0 and Q5_0 matrices on the weight in panels of 16 rows, any number of rows of x)
as built for every x86-64 level this CPU runs (tests/support/cpu_variants.py), against its torch reference bit for
bit: llama.cpp's arithmetic (x quantized per block of 32, each block's int8 products summed exactly), the blocks'
scaled sums added in order in float32 as torch's elementwise ops round them; Q5_0's outputs Q8_0's on the same
values; the bits whatever the thread count; the packings' round trips; refusals."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.models import quantized_linear as ql
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

# (inputs, outputs): the 0.5B's shapes, outputs short of a whole panel, a single block
SHAPES = [(896, 2 * 896 + 256), (4864, 37), (96, 1), (32, 9), (160, 61)]


def _q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 matrix's int8 values (the whole range) and float16 scales."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return q, (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half()


def _q5_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q5_0 matrix's values (-16..15) and float16 scales."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8)
    return q, (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half()


def _reference(q: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32: out = (...(s_0 + s_1) + ...) with s_b = isum_b * (d_w * d_x), each op rounded by torch."""
    n, k = q.shape
    xq, dx = ql.quantize_per_block(x)
    sums = torch.einsum("mbt,nbt->mnb", xq.view(-1, k // 32, 32).to(torch.int64), q.view(n, k // 32, 32).to(torch.int64))
    out = torch.zeros(x.shape[0], n)
    for b in range(k // 32):
        out = out + sums[..., b].float() * (scales[:, b].float().view(1, n) * dx[:, b].view(-1, 1))
    return out


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 19])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_panels_are_llamacpps_arithmetic_bit_for_bit_on_every_variant(variant, rows, k, n, dtype):
    q, scales = _q8_0(n, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0, :32] = 0  # a zero block: d = 0, its products 0
    panels, panel_scales = cpu_quantized.pack_q8_0_panels(q, scales)
    got = cpu_quantized.gemm_q8_0_panels(x, panels, panel_scales, n, out_dtype=torch.float32)
    want = _reference(q, scales, x)
    assert got.shape == (rows, n) and torch.equal(got, want)
    # and so within float32 sums of llama.cpp's in float64
    assert ((got.double() - ql.q8_0_reference(q, scales, x)).abs() <= 1e-5 * want.abs().max()).all()
    rounded = cpu_quantized.gemm_q8_0_panels(x, panels, panel_scales, n)  # x's dtype: rounded once
    assert rounded.dtype == dtype and torch.equal(rounded, want.to(dtype))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 19])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_q5_0_panels_give_q8_0s_outputs_on_the_same_values_on_every_variant(variant, rows, k, n, dtype):
    q, scales = _q5_0(n, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0, :32] = 0
    packed, packed_scales = cpu_quantized.pack_q5_0_panels(q, scales)
    got = cpu_quantized.gemm_q5_0_panels(x, packed, packed_scales, n, out_dtype=torch.float32)
    assert torch.equal(got, _reference(q, scales, x))
    assert torch.equal(cpu_quantized.gemm_q5_0_panels(x, packed, packed_scales, n), got.to(dtype))


def test_q5_0_packing_keeps_every_value_in_five_bits():
    q, scales = _q5_0(21, 96, seed=4)
    q[0, :64] = torch.arange(-16, 16, dtype=torch.int8).repeat(2)  # every value, in even and odd runs
    packed, packed_scales = cpu_quantized.pack_q5_0_panels(q, scales)
    assert packed.shape == (2, 3, 320) and packed.dtype == torch.uint8  # 10 bytes a 16 values
    values, back = cpu_quantized.unpack_q5_0_panels(packed, packed_scales, 21)
    assert torch.equal(values, q) and torch.equal(back, scales)
    with pytest.raises(ValueError, match="5-bit"):
        cpu_quantized.pack_q5_0_panels(q - 1, scales)


@pytest.mark.parametrize("k", [96, 896])
def test_sums_of_integers_are_exact_on_every_variant(variant, k):
    """Each block of x holding 127 (d = 1, x its own int8 values) and unit weight scales: the output is the int8
    products' sum, exactly (every partial sum is an integer below 2^24)."""
    gen = torch.Generator().manual_seed(k)
    q = torch.randint(-128, 128, (45, k), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (3, k), generator=gen).float()
    x.view(3, k // 32, 32)[..., 5] = 127.0
    panels, scales = cpu_quantized.pack_q8_0_panels(q, torch.ones(45, k // 32, dtype=torch.float16))
    got = cpu_quantized.gemm_q8_0_panels(x.bfloat16(), panels, scales, 45, out_dtype=torch.float32)
    assert torch.equal(got, (x.to(torch.int64) @ q.to(torch.int64).t()).float())


def test_many_rows_stream_the_weight_once_and_give_each_rows_own_outputs():
    """40 rows (five passes of 8 over each panel) equal the rows one at a time; strided rows are read as such."""
    q, scales = _q8_0(200, 896, seed=8)
    panels, panel_scales = cpu_quantized.pack_q8_0_panels(q, scales)
    x = torch.randn(40, 2 * 896, generator=torch.Generator().manual_seed(9)).bfloat16()[:, :896]
    got = cpu_quantized.gemm_q8_0_panels(x, panels, panel_scales, 200)
    one_by_one = torch.cat([cpu_quantized.gemm_q8_0_panels(x[i:i + 1], panels, panel_scales, 200) for i in range(40)])
    assert torch.equal(got, one_by_one) and torch.equal(got, _reference(q, scales, x).bfloat16())


def test_packing_round_trips_and_pads_the_last_panel_with_zeros():
    q, scales = _q8_0(21, 64, seed=4)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    panels, panel_scales = cpu_quantized.pack_q8_0_panels(q, scales)
    assert panels.shape == (2, 2, 8, 16, 4) and panel_scales.shape == (2, 2, 16)
    values, back = cpu_quantized.unpack_q8_0_panels(panels, panel_scales, 21)
    assert torch.equal(values, q) and torch.equal(back, scales)
    padded, padded_scales = cpu_quantized.unpack_q8_0_panels(panels, panel_scales, 32)
    assert not padded[21:].any() and not padded_scales[21:].any()


@pytest.mark.parametrize("five", [False, True], ids=["q8_0", "q5_0"])
def test_the_variant_is_named_and_the_bits_do_not_depend_on_the_thread_count(five):
    flags = set(cpu_native._cpu_flags().split())
    assert cpu_quantized.q8_0_variant() == ("avx512vnni" if {"avx512_vnni", "avx512bw"} <= flags
                                            else "avx2" if {"avx2", "f16c"} <= flags else "portable")
    q, scales = (_q5_0 if five else _q8_0)(1000, 896, seed=1)
    pack, gemm = ((cpu_quantized.pack_q5_0_panels, cpu_quantized.gemm_q5_0_panels) if five
                  else (cpu_quantized.pack_q8_0_panels, cpu_quantized.gemm_q8_0_panels))
    panels, panel_scales = pack(q, scales)
    x = torch.randn(11, 896, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = results_at_thread_counts(lambda: gemm(x, panels, panel_scales, 1000))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kind", ["q8_0", "q5_0"])
def test_a_layer_of_a_gguf_matrix_multiplies_every_row_count_on_the_panels(kind):
    """A GGUF Q8_0 matrix (Q5_0: its values in 5 bits) is packed in panels; in half precision, vectorized (VNNI or
    AVX2), they serve a prompt's rows too (no dequantized copy); in float32 the copy, the float model's products (transformers' oracle)."""
    q, scales = (_q8_0 if kind == "q8_0" else _q5_0)(40, 256, seed=7)
    layer = ql.make_int8(q, scales.float(), None, 32, torch.bfloat16, q8_0=True)
    assert layer.kind == kind
    x = torch.randn(600, 256, generator=torch.Generator().manual_seed(3))
    if cpu_quantized.q8_0_variant() in ("avx512vnni", "avx2"):
        assert torch.equal(layer.forward(x.bfloat16()), _reference(q, scales, x.bfloat16()).bfloat16())
    else:  # the plain loops' kernel copies from 16 rows
        want = torch.nn.functional.linear(x.bfloat16(), layer.dequantized(torch.bfloat16))
        assert torch.equal(layer.forward(x.bfloat16()), want)
    assert torch.equal(layer.forward(x[:2]), torch.nn.functional.linear(x[:2], layer.dequantized(torch.float32)))


def test_mismatched_inputs_are_refused():
    q, scales = _q8_0(32, 64, seed=3)
    panels, panel_scales = cpu_quantized.pack_q8_0_panels(q, scales)
    x = torch.randn(4, 64).bfloat16()
    for args in ((torch.randn(4, 96).bfloat16(), panels, panel_scales, 32),  # K differs
                 (torch.randn(0, 64).bfloat16(), panels, panel_scales, 32),  # no rows
                 (x.to(torch.int32), panels, panel_scales, 32),  # x not float
                 (x, panels.view(torch.int8), panel_scales, 32),  # not the packed bytes
                 (x, panels, panel_scales[:, :1], 32),  # one block's scales of two
                 (x, panels, panel_scales.float(), 32),  # Q8_0's scales are float16
                 (x, panels, panel_scales, 33)):  # more outputs than the panels hold
        with pytest.raises(ValueError, match="gemm_q8_0_panels"):
            cpu_quantized.gemm_q8_0_panels(*args)
    with pytest.raises(ValueError, match="pack_q8_0_panels"):
        cpu_quantized.pack_q8_0_panels(q[:, :48], scales[:, :1])
    q5, scales5 = _q5_0(32, 64, seed=3)
    packed5, packed_scales5 = cpu_quantized.pack_q5_0_panels(q5, scales5)
    with pytest.raises(ValueError, match="gemm_q5_0_panels"):
        cpu_quantized.gemm_q5_0_panels(x, panels, packed_scales5, 32)  # Q8_0's bytes
    with pytest.raises(ValueError, match="gemm_q8_0_panels"):
        cpu_quantized.gemm_q8_0_panels(x, packed5, packed_scales5, 32)  # Q5_0's


def test_where_the_kernel_has_only_plain_loops_a_layer_copies_from_16_rows(monkeypatch):
    """The plain loops' kernel (no AVX2) is slow at a prompt's rows (10.8 ms a 0.5B gate_up at 16): from 16 rows
    such a layer multiplies the dequantized copy, below them the kernel."""
    monkeypatch.setattr(ql, "_q8_0_vectorized", lambda: False)
    q, scales = _q8_0(40, 256, seed=11)
    layer = ql.make_int8(q, scales.float(), None, 32, torch.bfloat16, q8_0=True)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(12)).bfloat16()
    assert torch.equal(layer.forward(x), torch.nn.functional.linear(x, layer.dequantized(torch.bfloat16)))
    assert torch.equal(layer.forward(x[:15]), _reference(q, scales, x[:15]).bfloat16())
    assert "q8_0: native Q8_0 x Q8_0 GEMM" in ql.describe_ops([_Layer(layer)])
    assert "from 16 rows" in ql.describe_ops([_Layer(layer)])


class _Layer:
    """A decoder layer with one quantized projection, as describe_ops reads it."""

    def __init__(self, quantized):
        self.qkv = type("Projection", (), {"quantized": quantized})()
