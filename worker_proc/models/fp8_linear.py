"""An FP8 checkpoint's linear layer (compressed-tensors' FP8 and FP8_DYNAMIC presets, as llm-compressor writes
them): float8_e4m3fn weights with a scale per output channel or per tensor, and the layer's input rounded through
float8 first, per token with a scale of its own (dynamic) or by the checkpoint's ``input_scale`` (static).

On a GPU torch._scaled_mm multiplies the float8 values (``scaled_mm_serves``). CPUs have no float8 arithmetic
(AVX512-FP16 and AMX-FP16 are not e4m3), so where the native kernels build the weight stays float8, one byte a
weight, and a decode's 1-47 rows take kernels/cpu_gemv_int8.c, which widens the bytes to float32 in registers
(``q * scale``, as compressed-tensors' decompressor computes it); more rows multiply a dequantized copy made for the
call (kernels/cpu_dequantize.c, the same values), as W8A16 does. Without the native kernels the weight is
dequantized once at load and kept in the model's dtype on the float paths. What the checkpoint's scheme does to
the activations is kept, ``fake_quantize_fp8`` being compressed-tensors' forward (the oracle transformers runs):
scale = max|x| / 448 (the dtype's eps where 0), x / scale clamped to +-448, rounded to float8_e4m3fn (nearest
even) and multiplied back, in x's dtype; a static scale computes in float32, the scale's. In float32 the layer's
products are transformers' up to the order of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout, linear
from pagedserve.worker_proc.models.quantized_linear import QuantizedLinear
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fake_quantize_fp8(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None,
                      row_max: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x rounded through float8_e4m3fn: per row (token) by max|row| / 448 (``row_max`` [rows, 1] in x's dtype
    where given: a whole row's, of which x holds a slice), or by ``static_scale`` (a float32 scalar); the
    result in x's dtype. On CPU in one native pass (kernels/cpu_fp8_round.c), the same bits as torch's nine ops
    and 3-5x faster than them at 1-2048 rows (one row of 896: 5.8 against 27.6 us; 2048 of 4864: 8.9 against
    46 ms)."""
    if x.dim() == 2 and x.is_cpu and cpu_native.library() is not None:
        return cpu_native.fp8_round_rows(x if x.stride(1) == 1 else x.contiguous(), row_max,
                                         None if static_scale is None else float(static_scale))
    return fake_quantize_fp8_torch(x, static_scale, row_max)


def fake_quantize_fp8_torch(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None,
                            row_max: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fake_quantize_fp8 in torch's ops (compressed-tensors' own arithmetic): any device, and the native pass's
    reference."""
    q, scale = quantize_fp8(x, static_scale, row_max)
    return q.to(scale.dtype).mul_(scale).to(x.dtype)


def quantize_fp8(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None,
                 row_max: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8_e4m3fn, its scale): per token, max|row| / 448 in x's dtype ([rows, 1]; ``row_max`` where
    given; the dtype's eps where 0), or the static float32 scalar, x divided by it in float32."""
    if static_scale is None:
        scale = (x.abs().amax(-1, keepdim=True) if row_max is None else row_max) / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
        return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    return (x.float() / static_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), static_scale


@dataclass(slots=True)
class Fp8Linear:
    # on a CPU: the float8 bytes as an fp8_blocks layer (the int8 GEMV's), or without the native kernels q * scale
    # in the model's dtype on the float paths; None where torch._scaled_mm multiplies (float8_weight)
    weight: Optional[LinearWeight]
    out_features: int
    in_features: int
    activations: Optional[str]  # "token" (dynamic), "tensor" (static: ``input_scale``), None (unquantized)
    input_scale: Optional[torch.Tensor] = None  # float32 scalar
    # a row-parallel layer's ranks under tensor parallelism, dynamic activations: a token's scale is its whole
    # row's max, each rank holding a slice (the checkpoint's arithmetic: per-slice scales moved the logprobs of
    # a 2-rank test model by 0.1 nats, median)
    shard: Optional[TensorParallelShard] = None
    # scaled_mm: the float8 weight [out, in] as stored and its scale [1, out] float32, for torch._scaled_mm
    float8_weight: Optional[torch.Tensor] = None
    weight_scale: Optional[torch.Tensor] = None
    kind: str = "fp8"
    gate_size: int = 0  # no fused SiLU gate (models/linear.py silu_gate)

    @property
    def parts(self) -> tuple["Fp8Linear", ...]:
        return (self,)

    @property
    def nbytes(self) -> int:
        if self.float8_weight is not None:
            return self.float8_weight.nbytes
        w = self.weight
        if w.quantized is not None:
            return w.quantized.nbytes
        return min(t.nbytes for t in (w.weight, w.weight_t, w.packed, w.panels, w.gemv_panels) if t is not None)

    def _row_max(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if self.shard is None or self.activations != "token":
            return None
        return self.shard.row_absmax(x).reshape(-1, 1).to(x.dtype)  # exact: a max of x's own values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8_weight is not None:
            return self._scaled_mm(x)
        if self.activations is not None:
            x = fake_quantize_fp8(x, self.input_scale, self._row_max(x))
        return linear(x, self.weight)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x quantized to float8 (the scheme's scale: compressed-tensors' per token, or the static one), the
        float8 products summed in float32 and both scales applied by torch._scaled_mm (row-wise scales)."""
        x = x.contiguous()
        xq, scale = quantize_fp8(x, self.input_scale, self._row_max(x))
        x_scale = scale.float().reshape(-1, 1).expand(x.shape[0], 1).contiguous()  # static: one for every row
        return torch._scaled_mm(xq, self.float8_weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                out_dtype=x.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.float8_weight is not None:
            return (self.float8_weight.float() * self.weight_scale.t()).to(dtype)
        if self.weight.quantized is not None:
            return self.weight.quantized.dequantized(dtype)
        return self.weight.weight.to(dtype)


def scaled_mm_serves(device: torch.device, out_features: int, in_features: int,
                     activations: Optional[str]) -> bool:
    """Whether a layer multiplies in float8 (torch._scaled_mm): on a GPU, for a scheme that quantizes its
    activations, with the shapes the op takes (multiples of 16). CPUs have no float8 arithmetic: torch's CPU
    _scaled_mm is a reference loop (one row of 896 x 4864: 12.9 ms against bfloat16's 0.24)."""
    return device.type == "cuda" and activations is not None and out_features % 16 == 0 and in_features % 16 == 0


def make_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, layout: WeightLayout,
             activations: Optional[str], input_scale: Optional[torch.Tensor] = None,
             shard: Optional[TensorParallelShard] = None, device: torch.device = torch.device("cpu"),
             scaled_mm: Optional[bool] = None) -> Fp8Linear:
    """``values`` [out, in] the float8 weight widened to float32 (exact), ``scale`` [out, 1] float32; ``shard``:
    a row-parallel layer's (its input a slice of each row) under tensor parallelism. ``scaled_mm``: multiply in
    float8 (default: where scaled_mm_serves); else, on a CPU with the native kernels, the float8 bytes on the int8
    GEMV (``fp8_blocks``), or the weight dequantized at load."""
    n, k = values.shape
    if activations == "tensor" and input_scale is None:
        raise ValueError("a static float8 activation scheme needs the layer's input_scale")
    static = None if input_scale is None else input_scale.reshape(()).to(device, torch.float32)
    shard = shard if shard is not None and shard.size > 1 else None
    if scaled_mm if scaled_mm is not None else scaled_mm_serves(device, n, k, activations):
        return Fp8Linear(None, n, k, activations, static, shard,
                         values.to(device, torch.float8_e4m3fn).contiguous(),
                         scale.reshape(1, n).to(device, torch.float32).contiguous(), kind="fp8_scaled_mm")
    if device.type == "cpu" and cpu_native.library() is not None and k % 16 == 0:
        blocks = QuantizedLinear("fp8_blocks", n, k, values.to(torch.float8_e4m3fn).contiguous(),
                                 cpu_quantized.fp8_block_scales(scale.reshape(n, 1)), group_size=k)
        return Fp8Linear(LinearWeight(None, out_features=n, quantized=blocks), n, k, activations, static, shard)
    weight = (values * scale).to(device, dtype)
    return Fp8Linear(LinearWeight.of(weight, None, layout), n, k, activations, static, shard)
