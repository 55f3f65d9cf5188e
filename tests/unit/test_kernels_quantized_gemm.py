"""kernels/quantized_gemm.py, Triton W4A16 / W8A16 for a GPU: the weight dequantized in registers equals the
plain-torch product of the dequantized weight, in 4 and 8 bits, symmetric and with zero points, in groups and
per channel, at decode's one row and prefill's many, in float32 and bfloat16; the refusal of shapes it does
not take. Runs under TRITON_INTERPRET=1 on the CPU (small shapes: the interpreter is slow), or natively on a
GPU (support/kernel_device.py)."""

from support.kernel_device import DEVICE, MARKS, to_device  # first: it decides TRITON_INTERPRET

import pytest
import torch

from pagedserve.kernels import quantized_gemm

pytestmark = MARKS


def weight(n: int, k: int, bits: int, group: int, asymmetric: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (n, k), generator=gen, dtype=torch.int8)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    zero = torch.randint(-2, 3, (n, groups), generator=gen).float() if asymmetric else None
    return q, scale, zero


def dequantized(q, scale, zero, group):
    k = q.shape[1]
    expand = lambda t: t.repeat_interleave(group, dim=1)[:, :k]  # noqa: E731
    return (q.float() - (0 if zero is None else expand(zero))) * expand(scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits, group, asymmetric", [(4, 32, False), (4, 64, True), (8, 32, True), (8, 100, False)],
                         ids=["int4_g32", "int4_g64_asym", "int8_g32_asym", "int8_per_channel"])
@pytest.mark.parametrize("rows", [1, 19])
def test_the_product_is_the_dequantized_weights(dtype, bits, group, asymmetric, rows):
    n, k = 72, group if group == 100 else 96  # per channel: one group of every input (K = 100, no multiple of 32)
    q, scale, zero = weight(n, k, bits, group, asymmetric, seed=bits + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    stored = quantized_gemm.pack_int4(q) if bits == 4 else q
    expected = (x.float() @ dequantized(q, scale, zero, group).to(dtype).float().t()).to(dtype)
    x_d, stored_d, scale_d = to_device(x, stored, scale)
    zero_d = None if zero is None else to_device(zero)[0]
    out = quantized_gemm.int_weight_gemm(x_d, stored_d, scale_d, zero_d, group, bits)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.cpu(), expected, **tolerance)


def test_int4_packing_keeps_each_input_in_its_nibble():
    q = torch.tensor([[-8, 7, 0, -1, 3]], dtype=torch.int8)
    assert quantized_gemm.pack_int4(q).tolist() == [[0 | 15 << 4, 8 | 7 << 4, 11 | 8 << 4]]


def test_a_group_the_k_step_does_not_divide_is_refused():
    q, scale, _ = weight(16, 96, 8, 48, False, seed=1)
    with pytest.raises(ValueError, match="do not match"):
        quantized_gemm.int_weight_gemm(*to_device(torch.randn(2, 96), q, scale), None, 48, 8)


@pytest.mark.parametrize("bits, group, asymmetric", [(4, 64, True), (8, None, False)], ids=["w4a16_asym", "w8a16"])
def test_a_gpu_layer_is_the_plain_torch_reference_of_its_checkpoint(bits, group, asymmetric):
    """make_gpu_int (what worker_proc/quantization.py builds on a GPU for compressed-tensors, GPTQ and AWQ
    weight-only checkpoints) against quantized_linear.reference, the weight-only formats' oracle, in float32;
    inputs in a GPTQ activation order are gathered first, as every kind does."""
    from pagedserve.worker_proc.models import quantized_linear as ql

    n, k = 40, 128
    q, scale, zero = weight(n, k, bits, group or k, asymmetric, seed=11)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(11))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(12))
    layer = ql.make_gpu_int(q, scale, zero, group, bits, DEVICE, input_order=order)
    assert layer.kind == f"gpu_int{bits}"
    expected = ql.reference(q, scale, zero, group, x[:, order])
    torch.testing.assert_close(layer.forward(to_device(x)[0]).cpu(), expected, rtol=1e-5, atol=1e-5)
