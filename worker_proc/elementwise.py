"""A decoder layer's elementwise ops (norms, residual adds, rotary, SiLU gate), two ways.

``TorchElementwise`` is transformers' own op sequence, bit for bit: the greedy-parity
oracle holds in float32 on every device, and on CPU these ops are already few and large
(the native rotary kernel aside, cpu_native). ``FusedElementwise`` runs each as one Triton
kernel (kernels/fused_*.py). On a GPU at decode batch sizes those ops are ~25 of a layer's
~35 launches, each a few microseconds over a few kilobytes, so fusing them shortens the
step the GPU runs even inside a CUDA graph. Its rounding points follow transformers', but
its results are not bit for bit theirs (a norm's squares are summed in another order, and
rotary and SiLU differ by a rounding step here and there), so it is chosen where two engines
never agree bit for bit anyway: half precision on the Triton path. ``PAGEDSERVE_FUSED_OPS=0``
turns it off, ``=1`` takes it in float32 too (still only with the Triton kernels).

``NativeElementwise`` is the CPU's half-precision form (bfloat16, float16, where the native kernels are
built): the residual add and RMSNorm in one C pass (kernels/cpu_rms_norm_half.c), torch's roundings op
for op but its sum of squares in another order; q/k rotary and the KV write in one C call
(kernels/cpu_rotary_half.c, the rotary kernel's own bits), where rotary, then reference.write_kv's five
torch ops and a host read, cost ~33 us a layer hot at one stream against ~15; the SiLU gate of up to 8 rows
in one C pass (kernels/cpu_silu_mul_half.c: 8 us against torch's split, silu and mul_'s 10 at one row; torch's
from 9 rows, its exp the faster at 64); the rest transformers' sequence. One stream's decode step spends more in
the norms' six torch ops a call than in attention (bench/RESULTS.md, "CPU: one stream at the memory's speed"). ``PAGEDSERVE_FUSED_OPS=0`` turns it off too.
"""

from __future__ import annotations

from types import ModuleType
from typing import Union

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native, reference
from pagedserve.worker_proc.env_switch import env_switch

FUSED_ENV = "PAGEDSERVE_FUSED_OPS"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm op for op (x * x is what pow(2) computes, and the products commute), so
    bit for bit the same; the small intermediates and the result are updated in place,
    which halves the fresh full-size tensors (each a round of page faults on CPU)."""
    input_dtype = x.dtype
    h = x.float()
    h = h * (h * h).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return h.to(input_dtype).mul_(weight)


class TorchElementwise:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual), the sum written over x (the layer's own
        output, so no fresh tensor for it)."""
        total = x.add_(residual)
        return rms_norm(total, weight, eps), total

    def rotary(self, rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotary(x, positions)

    def rotary_write_kv(self, rotary, qk: torch.Tensor, positions: torch.Tensor, value: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        ops: ModuleType) -> torch.Tensor:
        """qk [T, q_heads + kv_heads, dim] rotated; its keys and ``value`` [T, kv_heads, dim] written to
        the cache's slots (ops.write_kv's contract)."""
        qk = self.rotary(rotary, qk, positions)
        ops.write_kv(qk[:, qk.shape[1] - value.shape[1]:], value, k_cache, v_cache, slot_mapping)
        return qk

    def silu_mul(self, gate_up: torch.Tensor, size: int) -> torch.Tensor:
        gate, up = gate_up.split(size, dim=-1)
        return F.silu(gate).mul_(up)


class FusedElementwise:
    name = "fused"

    def __init__(self):
        from pagedserve.kernels import fused_norm, fused_rotary, fused_silu_mul  # imports triton

        self._norm, self._rotary, self._silu_mul = fused_norm, fused_rotary, fused_silu_mul

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm.add_rms_norm(x, residual, weight, eps)

    def rotary(self, rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if rotary.rotary_dim != x.shape[-1]:  # a partial rotary: the kernel turns whole heads
            return rotary(x, positions)
        return self._rotary.rotary(x, rotary.cos, rotary.sin, positions)

    def silu_mul(self, gate_up: torch.Tensor, size: int) -> torch.Tensor:
        return self._silu_mul.silu_mul(gate_up, size)

    rotary_write_kv = TorchElementwise.rotary_write_kv


class NativeElementwise(TorchElementwise):
    name = "native"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dim() == 2 and not x.is_contiguous():
            # q and k normed per head (Qwen3, Gemma 3) are a slice of the fused qkv: copying their few KB a
            # token costs less than torch's six ops over them (~9% of a Gemma 3 1B decode step)
            x = x.contiguous()
        if cpu_native.supports_rms_norm(x, weight):
            return cpu_native.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_native.supports_rms_norm(x, weight) and residual.shape == x.shape and residual.dtype == x.dtype:
            return cpu_native.rms_norm(x, weight, eps, residual=residual), x
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, size: int) -> torch.Tensor:
        """One native pass (kernels/cpu_silu_mul_half.c) where torch's split, silu and mul_ are three ops."""
        if cpu_native.supports_silu_mul(gate_up):
            return cpu_native.silu_mul(gate_up, size)
        return super().silu_mul(gate_up, size)

    def rotary_write_kv(self, rotary, qk: torch.Tensor, positions: torch.Tensor, value: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        ops: ModuleType) -> torch.Tensor:
        """The rotation and the KV write in one native call (kernels/cpu_rotary_half.c), where it serves."""
        if (ops is reference and rotary.rotary_dim == qk.shape[-1]
                and cpu_native.supports_rotary_write_kv(qk, rotary.cos, value, k_cache, v_cache)):
            return cpu_native.rotary_write_kv(qk, rotary.cos, rotary.sin, positions, value, k_cache, v_cache,
                                              slot_mapping)
        return super().rotary_write_kv(rotary, qk, positions, value, k_cache, v_cache, slot_mapping, ops)


Elementwise = Union[TorchElementwise, FusedElementwise, NativeElementwise]


def select_elementwise(ops: ModuleType, dtype: torch.dtype) -> Elementwise:
    """Fused where the attention kernels are Triton's (CUDA, or the interpreter in tests) and
    the dtype is half precision; the native norm on CPU in half precision; transformers' sequence otherwise."""
    fused = env_switch(FUSED_ENV)
    half = dtype in (torch.bfloat16, torch.float16)
    if ops is not reference and (fused or (fused is None and half)):
        return FusedElementwise()
    if ops is reference and half and fused is not False and cpu_native.library() is not None:
        return NativeElementwise()
    return TorchElementwise()
