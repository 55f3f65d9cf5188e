"""The W8A8 kernel's checks (kernels/cpu_gemm_w8a8.c), run on this CPU's build (tests/unit/test_cpu_gemm_w8a8.py)
and on every x86-64 level's (tests/e2e/test_kernels_cpu_gemm_w8a8.py): exact int32 sums of the quantized rows,
the scaled result the plain-torch reference's bits, and a gate_up's SiLU gate in the epilogue the unfused path's
bits."""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.models.quantized_linear import make_w8a8, quantize_per_token, reference

ROWS = (1, 2, 3, 5, 6, 7, 8, 13, 64, 300)
SIZES = ((13, 37), (259, 129), (896, 80))  # (K, N): neither a multiple of a vector width, and a model's K
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [n, k] over the whole range, -128 included; float32 scales [n])."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) + 0.01


def check_int32_sums(k: int, n: int) -> None:
    """At every row count of ROWS (a zero row among them: scale 1), the kernel's row scales are
    quantize_per_token's and its int32 sums torch's int64 matmul of the same integers."""
    q, scale = random_weight(n, k, k + n)
    panels, sums = cpu_quantized.pack_w8a8_weight(q)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
        x[rows // 2] = 0
        x_scale = torch.empty(rows)
        acc = cpu_quantized.w8a8_linear(x, panels, sums, scale, n, out_dtype=torch.int32, x_scale_out=x_scale)
        xq, expected_scale = quantize_per_token(x)
        assert torch.equal(x_scale, expected_scale[:, 0]), rows
        assert torch.equal(acc.long(), xq.long() @ q.long().t()), rows


def check_reference_bits(dtype: torch.dtype) -> None:
    """The layer (on the kernel) returns the reference's bits: int sums * x scale * w scale, rounded once."""
    k, n = 259, 129
    q, scale = random_weight(n, k, 1)
    layer = make_w8a8(q, scale.reshape(n, 1))
    assert layer.w8a8_sums is not None  # the native kernel, not torch._int_mm
    for rows in (1, 7, 64):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
        assert torch.equal(layer.forward(x), reference(q, scale.reshape(n, 1), None, None, x, dynamic_int8=True))


def check_silu_gate_bits(dtype: torch.dtype) -> None:
    """A [gate; up] packed for the gate (make_w8a8 with gate_size): silu_gate() gives what the product then the
    activation give, rounded where they round (half precision: cpu_native.silu_mul's bits, the same silu;
    float32: torch's silu, whose exp is within an ulp of ours), and forward() still the product in the
    checkpoint's column order (what an adapter's delta adds to)."""
    k, size = 259, 48
    q, scale = random_weight(2 * size, k, 2)
    plain, gated = make_w8a8(q, scale.reshape(-1, 1)), make_w8a8(q, scale.reshape(-1, 1), gate_size=size)
    assert gated.gate_size == size and plain.gate_size == 0
    for rows in (1, 7, 64):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
        gate_up = plain.forward(x)
        assert torch.equal(gated.forward(x), gate_up)
        got = gated.silu_gate(x)
        if dtype == torch.float32:
            expected = torch.nn.functional.silu(gate_up[:, :size]) * gate_up[:, size:]
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, cpu_native.silu_mul(gate_up, size)), rows
