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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,d", [(1, 4, 1, 256), (7, 16, 8, 128), (64, 14, 2, 64)])
def test_per_head_weights_over_a_slice_of_the_fused_qkv_norm_each_head_by_its_own_row(dtype, tokens, q_heads,
                                                                                      kv_heads, d):
    """Qwen3's and Gemma 3's q and k norms: one [q_heads + kv_heads, d] weight over qkv[:, :q + k] viewed as heads."""
    gen = torch.Generator().manual_seed(tokens * 7 + d)
    qkv = (3 * torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen)).to(dtype)
    qk = qkv[:, :(q_heads + kv_heads) * d].view(tokens, q_heads + kv_heads, d)  # strided: v follows each row
    q_w, k_w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype), (0.5 * torch.randn(d, generator=gen)).to(dtype)
    weight = torch.cat([q_w.expand(q_heads, d), k_w.expand(kv_heads, d)])
    before = qkv.clone()
    ours, theirs = NativeElementwise().rms_norm(qk, weight, 1e-6), TorchElementwise().rms_norm(qk, weight, 1e-6)
    assert torch.equal(qkv, before)
    assert cpu_native.supports_rms_norm(qk.contiguous(), weight)
    differ = ours != theirs
    assert differ.float().mean() < 1e-3
    step = torch.finfo(dtype).eps * theirs.float().abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((ours.float() - theirs.float()).abs() <= 2 * step).all()
    # a k head normed by q's weight would differ far beyond a rounding step
    wrong = TorchElementwise().rms_norm(qk, q_w, 1e-6)
    assert not torch.allclose(ours[:, q_heads:].float(), wrong[:, q_heads:].float(), atol=0.05)
