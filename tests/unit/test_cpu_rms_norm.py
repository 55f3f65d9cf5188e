"""The CPU's native residual add + RMSNorm in half precision (kernels/cpu_rms_norm_half.c through
worker_proc/elementwise.NativeElementwise) against transformers' op sequence (TorchElementwise): the
residual sum bit for bit, the norm bit for bit but where torch's other order of the sum of squares moves
h * r across a rounding boundary (one step of the dtype, rarely)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.elementwise import NativeElementwise, TorchElementwise

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="native CPU kernels are not built here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,d", [(1, 896), (3, 37), (8, 64), (70, 896), (40, 4864)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_norm_is_transformers_sequence_within_one_step_rarely(dtype, rows, d, with_residual):
    gen = torch.Generator().manual_seed(rows * 31 + d)
    x = (3 * torch.randn(rows, d, generator=gen)).to(dtype)
    residual = torch.randn(rows, d, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    ours_x, theirs_x = x.clone(), x.clone()
    if with_residual:
        ours, ours_total = NativeElementwise().add_rms_norm(ours_x, residual, weight, 1e-6)
        theirs, theirs_total = TorchElementwise().add_rms_norm(theirs_x, residual, weight, 1e-6)
        assert ours_total is ours_x and torch.equal(ours_x, theirs_x)  # the sum, over x, bit for bit
    else:
        ours, theirs = NativeElementwise().rms_norm(ours_x, weight, 1e-6), TorchElementwise().rms_norm(x, weight, 1e-6)
        assert torch.equal(ours_x, x)
    assert ours.shape == theirs.shape and ours.dtype == dtype
    differ = ours != theirs
    assert differ.float().mean() < 1e-3
    step = torch.finfo(dtype).eps * theirs.float().abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((ours.float() - theirs.float()).abs() <= 2 * step).all()


def test_strided_or_float32_inputs_take_transformers_sequence():
    x, weight = torch.randn(4, 64).bfloat16(), torch.ones(64).bfloat16()
    strided = torch.randn(4, 128).bfloat16()[:, ::2]
    assert not cpu_native.supports_rms_norm(strided, weight)
    assert torch.equal(NativeElementwise().rms_norm(strided, weight, 1e-6),
                       TorchElementwise().rms_norm(strided, weight, 1e-6))
    assert not cpu_native.supports_rms_norm(x.float(), weight.float())
    assert cpu_native.supports_rms_norm(x, weight)
