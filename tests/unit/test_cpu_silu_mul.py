"""The CPU's native SiLU gate in half precision (kernels/cpu_silu_mul_half.c through
worker_proc/elementwise.NativeElementwise) against transformers' ops (TorchElementwise: split, silu, mul_):
bit for bit but where the kernel's exp (2 ulp against torch's 1) moves silu's float32 value across a rounding
boundary (one step of the dtype, rarely), the overflow edges included."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.elementwise import NativeElementwise, TorchElementwise

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,size", [(1, 4864), (3, 37), (8, 64), (8, 4864), (300, 1000)])
def test_native_gate_is_transformers_ops_within_one_step_rarely(dtype, rows, size):
    """Rows past SILU_MUL_MAX_ROWS (the threads' split) through the kernel itself."""
    gen = torch.Generator().manual_seed(rows * 31 + size)
    gate_up = (4 * torch.randn(rows, 2 * size, generator=gen)).to(dtype)
    ours = cpu_native.silu_mul(gate_up, size)
    theirs = TorchElementwise().silu_mul(gate_up, size)
    assert ours.shape == (rows, size) and ours.dtype == dtype
    differ = ours != theirs
    assert differ.float().mean() < 1e-3
    step = torch.finfo(dtype).eps * theirs.float().abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((ours.float() - theirs.float()).abs() <= 2 * step).all()


def test_the_exps_edges_are_torchs():
    """Past float32's exp range silu is g / inf (a signed zero) or g, and infinities and NaN come out as torch's."""
    gate = torch.tensor([0.0, -0.0, 87.5, -87.5, 88.5, -88.5, 89.0, -89.0, -100.0, 100.0, 1e-3, -1e-3,
                         float("inf"), float("-inf"), float("nan"), 3.0])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1).to(torch.bfloat16)
    ours = NativeElementwise().silu_mul(gate_up, gate.numel())
    theirs = TorchElementwise().silu_mul(gate_up, gate.numel())
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])
    assert torch.equal(ours.signbit(), theirs.signbit())


def test_other_inputs_take_transformers_ops():
    """float32, a gate_up that is not whole contiguous rows, or more rows than SILU_MUL_MAX_ROWS is torch's path; a
    width that is not two halves of the size is refused, not read past."""
    gate_up = torch.randn(2, 16)
    assert not cpu_native.supports_silu_mul(gate_up)
    assert torch.equal(NativeElementwise().silu_mul(gate_up, 8), TorchElementwise().silu_mul(gate_up, 8))
    strided = torch.randn(2, 32).to(torch.bfloat16)[:, :16]
    assert not cpu_native.supports_silu_mul(strided)
    assert torch.equal(NativeElementwise().silu_mul(strided, 8), TorchElementwise().silu_mul(strided, 8))
    assert cpu_native.supports_silu_mul(torch.zeros(cpu_native.SILU_MUL_MAX_ROWS, 16, dtype=torch.bfloat16))
    assert not cpu_native.supports_silu_mul(torch.zeros(cpu_native.SILU_MUL_MAX_ROWS + 1, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gate and an up"):
        cpu_native.silu_mul(torch.zeros(1, 10, dtype=torch.bfloat16), 6)
