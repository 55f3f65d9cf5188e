"""The fused elementwise kernels (RMSNorm with the residual add, rotary, SiLU gate) match
transformers' op sequence (worker_proc/elementwise.TorchElementwise), and a model run
through them decodes what the op sequence decodes.

They run under TRITON_INTERPRET=1 on CPU, or natively on a GPU (see kernel_device). The
interpreter truncates float32 to bfloat16 where a GPU rounds to nearest even, so half
precision is compared within a rounding step, and the residual sum bit for bit on a GPU.
"""

from support.kernel_device import DEVICE, MARKS, to_device  # first: it decides TRITON_INTERPRET

from types import SimpleNamespace

import pytest
import torch

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.kernels import fused_norm, fused_rotary, fused_silu_mul, reference, triton_ops
from pagedserve.worker_proc import elementwise
from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.elementwise import FusedElementwise, TorchElementwise, select_elementwise
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.rotary import RotaryEmbedding
from support.worker_harness import TrivialScheduler, hf_greedy, random_prompts

pytestmark = MARKS

TORCH = TorchElementwise()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # float32: a few ulps (the sum of squares is added in another order); half precision: one rounding step.
    tol = dict(rtol=1e-5, atol=1e-5) if actual.dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tol)


def exact_on_gpu(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Half precision on a GPU: bit for bit (one rounding of an exact float32 sum, as torch's)."""
    if DEVICE.type == "cuda" and actual.dtype != torch.float32:
        assert torch.equal(actual.cpu(), expected.cpu())
    else:
        close(actual, expected)


def randn(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 40), (7, 896), (3, 2048)])
def test_rms_norm_of_strided_rows_matches_the_op_sequence(dtype, rows, width):
    wide, weight = to_device(randn(rows, width + 24, dtype=dtype), randn(width, dtype=dtype, seed=1))
    x = wide[:, 8 : 8 + width]  # rows apart by more than their width, as a slice of a fused projection
    close(fused_norm.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_q_and_k_inside_a_fused_qkv_row(dtype):
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    qkv, weight = to_device(randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype),
                            randn(heads + kv_heads, dim, dtype=dtype, seed=1))
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    close(fused_norm.rms_norm(qk, weight, 1e-6), TORCH.rms_norm(qk, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_leaves_the_sum_in_x_and_norms_it(dtype):
    x, residual, weight = to_device(randn(6, 200, dtype=dtype), randn(6, 200, dtype=dtype, seed=1),
                                    randn(200, dtype=dtype, seed=2))
    expected_sum = x + residual
    normed, total = fused_norm.add_rms_norm(x, residual, weight, 1e-5)
    assert total.data_ptr() == x.data_ptr()
    exact_on_gpu(total, expected_sum)
    close(normed, TORCH.rms_norm(expected_sum, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_every_q_and_k_head_as_the_table_path(dtype):
    tokens, heads, kv_heads, dim = 9, 6, 2, 64
    table = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0, rope_scaling=None), dim, 300, DEVICE, dtype)
    qkv = to_device(randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype))[0]
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    positions = to_device(torch.tensor([0, 1, 2, 299, 17, 17, 150, 3, 64]))[0]
    expected = table.torch_rotate(qk, positions)
    # Not bit for bit: on an H200 some bfloat16 elements differed by a rounding step.
    close(fused_rotary.rotary(qk, table.cos, table.sin, positions), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [24, 1100])
def test_silu_mul_of_the_gate_up_projection(dtype, size):
    gate_up = to_device(randn(4, 2 * size, dtype=dtype) * 4)[0]
    close(fused_silu_mul.silu_mul(gate_up, size), TORCH.silu_mul(gate_up, size))  # exp: another approximation


def test_no_tokens_gives_empty_outputs_and_launches_nothing():
    weight = to_device(randn(16, dtype=torch.float32))[0]
    empty = to_device(torch.empty(0, 16))[0]
    assert fused_norm.rms_norm(empty, weight, 1e-6).shape == (0, 16)
    assert fused_silu_mul.silu_mul(to_device(torch.empty(0, 32))[0], 16).shape == (0, 16)


def test_fused_ops_are_chosen_for_half_precision_triton_and_can_be_set(monkeypatch):
    monkeypatch.delenv(elementwise.FUSED_ENV, raising=False)
    assert isinstance(select_elementwise(triton_ops, torch.bfloat16), FusedElementwise)
    assert isinstance(select_elementwise(triton_ops, torch.float16), FusedElementwise)
    assert isinstance(select_elementwise(triton_ops, torch.float32), TorchElementwise)  # the oracle's regime
    native = elementwise.NativeElementwise if cpu_native.library() is not None else TorchElementwise
    assert type(select_elementwise(reference, torch.bfloat16)) is native  # CPU: the native norm in half precision
    assert type(select_elementwise(reference, torch.float32)) is TorchElementwise  # the oracle's regime
    monkeypatch.setenv(elementwise.FUSED_ENV, "0")
    assert isinstance(select_elementwise(triton_ops, torch.bfloat16), TorchElementwise)
    assert type(select_elementwise(reference, torch.bfloat16)) is TorchElementwise
    monkeypatch.setenv(elementwise.FUSED_ENV, "1")
    assert isinstance(select_elementwise(triton_ops, torch.float32), FusedElementwise)
    assert isinstance(select_elementwise(reference, torch.float32), TorchElementwise)
    monkeypatch.setenv(elementwise.FUSED_ENV, "yes")
    with pytest.raises(ValueError, match=elementwise.FUSED_ENV):
        select_elementwise(triton_ops, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_greedy_tokens_through_the_fused_ops_equal_transformers(tmp_path, monkeypatch, arch):
    """float32 (PAGEDSERVE_FUSED_OPS=1), so transformers' tokens are the reference; qwen3 takes
    the per-head q/k norm, qwen2 the q/k/v bias. Chunked and late prefills beside decodes."""
    model_dir = str(build_model_dir(tmp_path / "m", arch, num_layers=2))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    monkeypatch.setenv(elementwise.FUSED_ENV, "1")
    runner = ModelRunner(model_dir, device=str(DEVICE), cuda_graphs=DEVICE.type == "cuda")
    assert isinstance(runner.model.elementwise, FusedElementwise)
    prompts = random_prompts([11, 6, 9], vocab_size=512, seed=3)
    scheduler = TrivialScheduler(runner)
    scheduler.add("chunked", prompts[0], 5, prefill_chunks=[4])
    scheduler.add("late", prompts[1], 5, arrival_step=1)
    scheduler.add("plain", prompts[2], 5)
    outputs = scheduler.run()
    assert [outputs["chunked"], outputs["late"], outputs["plain"]] == hf_greedy(model_dir, prompts, 5)

