"""kernels/cpu_dequantize.c, the copy a quantized layer multiplies from enough rows of x on, as built for every x86-64
level this CPU runs (tests/support/cpu_variants.py): the same bits as torch's ops make from the integers (q * scale,
(nibble - z) * scale, GGUF Q4_K's nibble * scale - min, in float32, then one rounding to the dtype) for each layout
the decode kernels read, whatever the thread count; a layer's product from many rows equals the one from that copy;
shapes a layout cannot hold are refused before anything is read."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.models import quantized_linear as ql
from support.cpu_variants import variant  # noqa: F401 (a fixture)
from support.thread_counts import results_at_thread_counts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (outputs, inputs): a 0.5B's gate_up and down_proj cut short, odd row counts (a panel's last rows)
SHAPES = [(37, 896), (9, 4864), (1, 64), (203, 128)]


def _scales(n: int, k: int, group: int, gen: torch.Generator, half: bool) -> torch.Tensor:
    s = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-4
    s[0, 0] = 0.0  # a zero block, as a pruned checkpoint has
    return s.half() if half else s


def _torch_values(q: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    return (q.float().view(n, k // group, group) * scales.float().unsqueeze(-1)).view(n, k).to(dtype)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int8_blocks", "int8_blocks_f16", "q8_0", "q5_0"])
def test_int8_layouts_give_torchs_q_times_scale_bits(variant, kind, n, k, dtype):
    gen = torch.Generator().manual_seed(n + k)
    low, high = (-16, 16) if kind == "q5_0" else (-128, 128)
    q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)
    group = 16 if kind == "int8_blocks" else 32
    scales = _scales(n, k, group, gen, half=kind != "int8_blocks")
    packed, stored_scales = q, scales
    if kind in ("q8_0", "q5_0"):
        pack = cpu_quantized.pack_q8_0_panels if kind == "q8_0" else cpu_quantized.pack_q5_0_panels
        packed, stored_scales = pack(q, scales)
    got = cpu_quantized.dequantize(kind.removesuffix("_f16"), packed, stored_scales, n, k, group, dtype)
    assert got.dtype == dtype and torch.equal(got, _torch_values(q, scales, group, dtype))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["symmetric", "zero_points", "q4_k_mins"])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_nibbles_give_torchs_bits(variant, form, group, n, k, dtype):
    gen = torch.Generator().manual_seed(3 * n + k)
    nibbles = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = _scales(n, k, group, gen, half=False)
    other = torch.rand(n, k // group, generator=gen) * 0.1
    zeros = 8 + torch.randint(-3, 4, (n, k // group), generator=gen).float() if form == "zero_points" else None
    mins = other if form == "q4_k_mins" else None
    values = nibbles.float().view(n, k // group, group)
    if mins is not None:  # GGUF's order of operations: scale * nibble, then the min
        want = values.mul(scales.unsqueeze(-1)).sub(mins.unsqueeze(-1))
    else:
        want = values.sub(8.0 if zeros is None else zeros.unsqueeze(-1)).mul(scales.unsqueeze(-1))
    got = cpu_quantized.dequantize("int4_blocks", cpu_quantized.pack_int4_blocks(nibbles), scales, n, k, group, dtype,
                                   zeros=zeros, mins=mins)
    assert torch.equal(got, want.view(n, k).to(dtype))


def test_the_bits_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-16, 16, (1000, 896), generator=gen, dtype=torch.int8)
    scales = _scales(1000, 896, 32, gen, half=True)
    packed, scales = cpu_quantized.pack_q5_0_panels(q, scales)
    outs = results_at_thread_counts(lambda: cpu_quantized.dequantize("q5_0", packed, scales, 1000, 896, 32,
                                                                     torch.bfloat16))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kind", ["int8_blocks", "int4_blocks"])
def test_a_layer_multiplies_many_rows_by_the_copy(kind):
    """From DEQUANTIZE_MIN_ROWS rows a layer's product is F.linear on the copy, the decode kernel's below."""
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 256
    if kind == "int4_blocks":
        layer = ql.make_int4(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8),
                             torch.rand(n, k // 32, generator=gen) * 0.02, None, 32, torch.bfloat16,
                             mins=torch.rand(n, k // 32, generator=gen) * 0.1)
    else:
        layer = ql.make_int8(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
                             torch.rand(n, k // 32, generator=gen) * 0.02, None, 32, torch.bfloat16)
    assert layer.kind == kind
    rows = ql.dequantize_min_rows(kind, torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    copy = layer.dequantized(torch.bfloat16)
    assert torch.equal(layer.forward(x), torch.nn.functional.linear(x, copy))
    assert torch.equal(copy.float(), layer.dequantized(torch.float32).bfloat16().float())


@pytest.mark.parametrize("group", [32, None])  # None: per output channel, one block a row
def test_float32_decode_rows_of_int8_blocks_run_the_kernel_not_a_copy(group, monkeypatch):
    """float32 (what --dtype auto gives a bf16 checkpoint on a CPU without bfloat16 arithmetic) multiplies a few rows
    on the int8 GEMV, as half precision does: a copy per call made a 0.5B W8A16 decode step 266-335 ms against
    38-39 on the kernel (bench/log); a per-channel weight is one block a row."""
    gen = torch.Generator().manual_seed(8)
    n, k = 40, 256
    scales = torch.rand(n, 1 if group is None else k // group, generator=gen) * 0.02
    layer = ql.make_int8(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), scales, None, group,
                         torch.float32)
    assert layer.kind == "int8_blocks" and layer.group_size == (group or k)
    copies = []
    monkeypatch.setattr(ql.QuantizedLinear, "dequantized", lambda self, dtype: copies.append(dtype))
    x = torch.randn(3, k, generator=gen)
    got = layer.forward(x)
    want = x.double() @ (layer.weight.double().view(n, k // layer.group_size, -1)
                         * layer.scales.double().unsqueeze(-1)).view(n, k).t()
    assert copies == [] and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert ql.dequantize_min_rows("int8_blocks", torch.float32) == ql.dequantize_min_rows("int8_blocks", torch.bfloat16)


@pytest.mark.parametrize("kind,packed,scales,n,k,group", [
    ("q8_0", torch.zeros(1, 3, 8, 16, 4, dtype=torch.uint8), torch.zeros(8, 3, dtype=torch.float16), 8, 96, 32),  # rows' scales
    ("q5_0", torch.zeros(1, 2, 320, dtype=torch.uint8), torch.zeros(1, 2, 16), 8, 64, 32),  # float32 scales
    ("int4_blocks", torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 3), 4, 48, 16),  # groups of 16
    ("int8_blocks", torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3), 4, 64, 32),  # 3 scales, 2 groups
    ("int4", torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2), 4, 64, 32),  # torch's layout: not this
])
def test_a_shape_the_layout_cannot_hold_is_refused(kind, packed, scales, n, k, group):
    with pytest.raises(ValueError, match="dequantize"):
        cpu_quantized.dequantize(kind, packed, scales, n, k, group, torch.bfloat16)
