"""A quantized linear layer: integer weights, their scales (and zero points), and the torch op
that multiplies them, chosen at load by the checkpoint's scheme (worker_proc/quantization.py).

No float copy of a quantized weight is kept: every path multiplies the integers as stored.

- ``int4`` (W4A16, groups of 32-256, symmetric or asymmetric): torch's
  ``_weight_int4pack_mm_for_cpu`` over ``_convert_weight_to_int4pack_for_cpu``'s layout, which
  computes ``(q - 8) * scale + zero`` per group in the activations' dtype. compressed-tensors' nibble
  is its signed value + 8, so ``q - 8`` is the signed value: zero is 0 (symmetric) or
  ``-zero_point * scale``. A per-channel int4 weight takes the largest group that divides its
  inputs, every group with the channel's scale.
- ``int4_blocks`` (the same weights, groups of a multiple of 32: W4A16, GGUF's Q4_0; and GGUF's Q4_K, each group
  of 32 ``scale * nibble - min`` with a float min, ``nibble_mins``), where the native kernels are built:
  kernels/cpu_gemv_int4.c, the nibbles unpacked and scaled in registers, float32 sums, 8 rows a pass, in every
  dtype (float32 too: no dequantized copy; bfloat16 x by vdpbf16ps where the CPU has AVX512-BF16, float32 and
  float16 x unrounded); from 128 rows the dequantized weight.
- ``int8`` (W8A16 per channel, asymmetric; symmetric too where the native kernels are not built): torch's
  ``_weight_int8pack_mm``, x @ (q * scale).T; an asymmetric weight subtracts rowsum(x) * zero_point * scale after.
- ``int8_blocks`` (W8A16 in groups of a multiple of 16, symmetric: compressed-tensors' int8 groups, GGUF's Q6_K; and
  a symmetric per-channel weight, one block a row), where the native kernels are built: kernels/cpu_gemv_int8.c
  (each block's integers widened in registers, float32 sums scaled once a block, 8 rows a pass), float32 too;
  from 48 rows the dequantized weight. A 0.5B's W8A16 decode step: 22.7 ms per channel and 23.8 in groups of 128
  against bf16's 29.3 (torch's op: 34.7; float32's copy per call: 266 and 335 ms, now 38-39; bench/log).
- ``q8_0`` (a GGUF Q8_0 matrix, where the native kernels are built): multiplied as llama.cpp's CPU backend does,
  x quantized per block of 32 too (d = max|x| / 127, round half to even), each block's int8 products summed exactly
  in int32 and scaled by both blocks' d, the weight in panels of 16 rows with its float16 scales, the file's
  (cpu_quantized.pack_q8_0_panels; kernels/cpu_gemm_q8_0.c, VNNI's vpdpbusd where the CPU has it), every row
  count in one pass over the weight. llama.cpp, the format's reference implementation, multiplies it so; the
  difference from transformers' float products is x's rounding to int8 per block, at most d / 2 an input. In
  float32: the dequantized weight, transformers' products.
- ``q5_0`` (such a matrix whose values all fit in 5 bits, [-16, 15]: GGUF's Q5_0, which the reader gives as
  Q8_0 blocks): the same arithmetic and outputs on the weight packed 5 bits a value (pack_q5_0_panels), 20 bytes a
  block of 32 against 32; in float32 the dequantized weight.
- ``int8_grouped`` (W8A16 in groups, elsewhere): the same op once per group of inputs, summed (torch has no
  grouped int8 op).
- ``w8a8`` (int8 weights per channel, int8 activations per token, both symmetric): each row of x
  scaled to int8 (compressed-tensors' rounding: round half to even, clamp to [-128, 127]), the int8
  products summed exactly in int32 and the two scales applied in float32. Where the native kernels
  build, one call of kernels/cpu_gemm_w8a8.c does it all at every row count (x read once; VNNI's
  vpdpbusd, AVX2's vpmaddubsw, or scalar), on the weight packed at load; else ``quantize_per_token``
  and ``torch._int_mm``.

From ``DEQUANTIZE_MIN_ROWS`` rows (16-128 in half precision: prefill chunks; every row in float32,
where torch's int ops have no vectorized path) a weight-only layer instead multiplies a dequantized copy
of its weight made for the call and freed after it (F.linear: oneDNN or oneMKL GEMM), since torch's
int ops above run a row at a time, and the native kernels take 8 rows a pass over the weight. The native
layouts are dequantized in one pass over the weight (kernels/cpu_dequantize.c), the others by torch's ops.
At most one layer's weight is ever held in float, for one call.
Each has its plain-torch reference (``reference``), the test oracle.

A GPTQ checkpoint in activation order (``desc_act``) has its weight's inputs put in group order at load
(worker_proc/gptq_awq_weights.py); its layer keeps that order (``input_order``) and gathers each call's
activations in it first, whichever kind runs: the product is the same sum, over the inputs reordered.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pagedserve.kernels import cpu_native, cpu_quantized
from pagedserve.worker_proc.model_config import UnsupportedModelError

if TYPE_CHECKING:
    from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

KINDS = ("int4", "int4_blocks", "int8", "int8_blocks", "fp8_blocks", "q8_0", "q5_0", "int8_grouped", "w8a8",
         "gpu_int4", "gpu_int8")


@dataclass(slots=True)
class QuantizedLinear:
    kind: str
    out_features: int
    in_features: int
    weight: torch.Tensor  # int4: torch's int4pack layout [out, in / 2] uint8; int4_blocks: [out, in / 2] uint8
    # (cpu_quantized.pack_int4_blocks); int8, int8_blocks: [out, in]; q8_0, q5_0: cpu_quantized.pack_q8_0_panels' and
    # pack_q5_0_panels' layouts;
    # int8_grouped: [groups, out, group_size]; w8a8: cpu_quantized.pack_w8a8_weight's panels, or (no native
    # kernels) [in, out] int8 (_int_mm's right operand)
    scales: torch.Tensor  # int4: [in / group, out, 2] (scale, zero); int8 / w8a8: [out]; int8_grouped: [groups, out];
    # int8_blocks, int4_blocks: [out, groups] float32; q8_0, q5_0: the file's float16 in panels (pack_q8_0_panels)
    group_size: int = 0
    zero_correction: Optional[torch.Tensor] = None  # int8 asymmetric: zero_point * scale, [out] or [groups, out]
    nibble_zeros: Optional[torch.Tensor] = None  # int4_blocks asymmetric: 8 + zero_point, [out, groups] float32
    nibble_mins: Optional[torch.Tensor] = None  # int4_blocks of a GGUF Q4_K: W = scale * nibble - min, [out, groups]
    input_order: Optional[torch.Tensor] = None  # [in] int64: the checkpoint's input of each weight column (desc_act)
    w8a8_sums: Optional[torch.Tensor] = None  # w8a8 on the native kernel: 128 * each packed column's sum, int32
    # w8a8 on the native kernel, a gated MLP's [gate; up]: its gate rows, the columns packed in
    # cpu_quantized.gated_order (``weight``, ``scales``, ``w8a8_sums``) for silu_gate()
    gate_size: int = 0
    zero_points: Optional[torch.Tensor] = None  # gpu_int4 / gpu_int8 asymmetric: [out, groups] float32
    # w8a8, a row-parallel layer's ranks under tensor parallelism: a token's scale is its whole row's max |x|, each
    # rank holding a slice (the checkpoint's arithmetic, as models/fp8_linear.py does)
    shard: Optional["TensorParallelShard"] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ W.T: [rows, out] in x's dtype."""
        x = x.contiguous() if self.input_order is None else x.index_select(-1, self.input_order)
        if self.kind in ("gpu_int4", "gpu_int8"):
            from pagedserve.kernels import quantized_gemm  # imports triton

            bits = 4 if self.kind == "gpu_int4" else 8
            return quantized_gemm.int_weight_gemm(x, self.weight, self.scales, self.zero_points,
                                                  self.group_size or self.in_features, bits)
        if self.kind != "w8a8" and x.shape[0] >= dequantize_min_rows(self.kind, x.dtype) and self.can_dequantize():
            return torch.nn.functional.linear(x, self.dequantized(x.dtype))
        if self.kind == "q5_0":
            return cpu_quantized.gemm_q5_0_panels(x, self.weight, self.scales, self.out_features)
        if self.kind == "q8_0":
            return cpu_quantized.gemm_q8_0_panels(x, self.weight, self.scales, self.out_features)
        if self.kind in ("int8_blocks", "fp8_blocks"):  # the kernel reads float8 weights by their dtype
            return cpu_quantized.gemv_int8_blocks(x, self.weight, self.scales, self.group_size)
        if self.kind == "int4_blocks":
            return cpu_quantized.gemv_int4_blocks(x, self.weight, self.scales, self.nibble_zeros, self.group_size,
                                               mins=self.nibble_mins)
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group_size, self.scales)
        if self.kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
            if self.zero_correction is not None:
                out -= x.sum(-1, keepdim=True) * self.zero_correction
            return out
        if self.kind == "int8_grouped":
            g = self.group_size
            out = None
            for i in range(self.weight.shape[0]):
                part = x[:, i * g:(i + 1) * g].contiguous()
                y = torch.ops.aten._weight_int8pack_mm(part, self.weight[i], self.scales[i])
                if self.zero_correction is not None:
                    y -= part.sum(-1, keepdim=True) * self.zero_correction[i]
                out = y if out is None else out.add_(y)
            return out
        row_max = None if self.shard is None else self.shard.row_absmax(x)
        if self.w8a8_sums is not None:
            out = cpu_quantized.w8a8_linear(x, self.weight, self.w8a8_sums, self.scales, self.out_features,
                                            x_absmax=row_max)
            if self.gate_size:  # an adapter's delta joins [gate; up] in the checkpoint's order
                out = out.view(-1, self.gate_size // 16, 2, 16).transpose(1, 2).reshape(out.shape)
            return out
        xq, x_scale = quantize_per_token(x, row_max)
        acc = torch._int_mm(xq, self.weight)
        return (acc.float() * x_scale * self.scales).to(x.dtype)

    def silu_gate(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up from a W8A8 gate_up made with gate_size: in the kernel's epilogue, where forward()
        then an activation would write and read back the [rows, 2 * gate_size] product (bench/log/2026-12-07.md,
        "W8A8: the SiLU gate in the GEMM's epilogue")."""
        return cpu_quantized.w8a8_silu_gate(x.contiguous(), self.weight, self.w8a8_sums, self.scales, self.gate_size)

    def can_dequantize(self) -> bool:
        return self.kind != "int4" or (self.out_features % INT4_BLOCK_N == 0 and _int4_layout_known())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``, made for one call and freed after it: q * scale (+ zero),
        per group, the products compressed-tensors' dequantize makes (float32: the same values)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.kind in cpu_quantized.DEQUANTIZE_FORMATS:  # layouts made only where the native kernels build
            return cpu_quantized.dequantize(self.kind, self.weight, self.scales, n, k, g, dtype, zeros=self.nibble_zeros,
                                            mins=self.nibble_mins)
        if self.kind == "int4":
            scale, zero = self.scales[..., 0].t().to(dtype), self.scales[..., 1].t().to(dtype)
            signed = _unpack_int4pack(self.weight, n, k).to(dtype).sub_(8).view(n, k // g, g)
            w = signed.mul_(scale.unsqueeze(-1))
            if zero.any():
                w.add_(zero.unsqueeze(-1))
            return w.view(n, k)
        if self.kind == "int8":
            w = self.weight.to(dtype).mul_(self.scales.to(dtype).unsqueeze(-1))
            return w if self.zero_correction is None else w.sub_(self.zero_correction.to(dtype).unsqueeze(-1))
        w = self.weight.to(dtype).mul_(self.scales.to(dtype).unsqueeze(-1))  # [groups, out, group_size]
        if self.zero_correction is not None:
            w.sub_(self.zero_correction.to(dtype).unsqueeze(-1))
        return w.permute(1, 0, 2).reshape(n, k)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8_blocks, q8_0 or q5_0 weight's values [out, in] int8 and scales [out, in / group], row-major."""
        if self.kind == "q5_0":
            return cpu_quantized.unpack_q5_0_panels(self.weight, self.scales, self.out_features)
        if self.kind == "q8_0":
            return cpu_quantized.unpack_q8_0_panels(self.weight, self.scales, self.out_features)
        return self.weight, self.scales

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.zero_correction, self.nibble_zeros, self.nibble_mins, self.input_order,
                                       self.w8a8_sums, self.zero_points) if t is not None)
        return self.weight.nbytes + self.scales.nbytes + extra

    @property
    def parts(self) -> tuple["QuantizedLinear", ...]:
        return (self,)


@dataclass(slots=True)
class QuantizedStack:
    """A fused projection whose parts are stored in different quantized forms (a GGUF Q4_K_M's q and k in Q4_K
    beside v in Q6_K on its "more bits" layers): each part multiplies x as its own layer and the outputs sit side by
    side, the fused layer's output, so no part is read in float."""
    parts: tuple[QuantizedLinear, ...]
    kind: str = "stack"
    gate_size: int = 0  # no fused SiLU gate (models/linear.py silu_gate)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.forward(x) for p in self.parts], dim=-1)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantized(dtype) for p in self.parts])


# From this many rows (bfloat16 / float16) a weight-only layer multiplies a dequantized copy of its
# weight, made for the call, instead of torch's int8 / int4 op, which runs about a row at a time.
# One 0.5B layer's four projections, one thread, bfloat16, op / dequantized (bf16 packed): int8
# 3.2 / 6.1 ms at 16 rows, 16.3 / 16.6 at 64, 71 / 57 at 256 (31); int4 8.4 / 27.5 at 32, 23 / 48 at
# 64, 94 / 68 at 256; int8 in groups (an op call per group) 10.9 / 9.1 at 16
# (bench/scripts/quant_bench.py). float32 has no vectorized int op at all (int8 22 ms at one row,
# 4.1 s at 256; dequantized 21 ms and 178 ms), so it dequantizes but where a native GEMV takes float32 x
# (int4_blocks, int8_blocks: the same crossover as half precision).
# The native layouts (int8_blocks, q8_0, q5_0, int4_blocks) are dequantized in one pass (kernels/cpu_dequantize.c;
# torch's ops took 10-20 ms for a 0.5B gate_up on two threads, the native pass ~1 ms hot). Their decode kernels take
# 8 rows of x a pass over the weight, so from a few passes the copy and oneDNN's bf16 product win. Two threads, the
# weights cold (a pass over 12 layers of a 0.5B's gate_up, 9728 x 896), kernel against copy + product, ms a layer
# (bench/log, sixth session): int4_blocks 1.32 / 2.15 at 8, 2.64 / 2.43 at 16, 4.00 / 2.82 at 24 (the 0.5B's Q4_K_M at 16 streams decoded
# its steps no faster with the copy at 16 rows: matmuls 72.8 and 64.6 ms a step against 67.0 and 62.6 with the
# kernel, so 16 rows stay on it); int8_blocks in blocks of 16 (GGUF Q6_K) 4.12 / 4.97 at 32, 6.10 / 5.61 at 48.
# q8_0 and q5_0 never copy in half precision where their GEMM is vectorized (VNNI's vpdpbusd, AVX2's vpmaddubsw): it
# streams the weight once for every row of x and multiplies int8 at twice bf16's rate: on VNNI q8_0 0.83 / 3.30 at
# 16 rows, 4.23 / 9.44 at 128, 15.9 / 26.2 at 512; q5_0 0.67 / 7.24 at 16, 4.17 / 12.1 at 128, 8.15 / 18.0 at 256
# (bench/log, seventh session); a CPU with AVX2 only has no bf16 product for the copy to feed either. The plain
# loops (no AVX2) took 10.8 ms for a gate_up at 16 rows, so they copy from 16 rows.
DEQUANTIZE_MIN_ROWS = {"int8": 128, "int8_grouped": 16, "int4": 128, "int8_blocks": 48, "fp8_blocks": 48, "q8_0": 16,
                       "q5_0": 16, "int4_blocks": 17}
_NO_COPY_WHEN_VECTORIZED = ("q8_0", "q5_0")
_FLOAT32_X_KERNELS = ("int4_blocks", "int8_blocks", "fp8_blocks")  # native GEMVs that take float32 x as it is


def dequantize_min_rows(kind: str, dtype: torch.dtype) -> float:
    if dtype == torch.float32 and kind not in _FLOAT32_X_KERNELS:
        return 1
    return math.inf if _never_copies(kind) else DEQUANTIZE_MIN_ROWS[kind]


def _never_copies(kind: str) -> bool:
    """Whether a half-precision call of this kind always runs its kernel (q8_0 and q5_0, VNNI or AVX2)."""
    return kind in _NO_COPY_WHEN_VECTORIZED and _q8_0_vectorized()


@functools.cache
def _q8_0_vectorized() -> bool:
    return cpu_quantized.q8_0_variant() in ("avx512vnni", "avx2")


INT4_BLOCK_N = 64  # torch's CPU int4 layout: blocks of 64 output rows


def _unpack_int4pack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """torch's CPU int4 layout [n, k / 2] uint8 (per block of 64 rows, [k, 32] bytes: row j in the
    low nibble, row j + 32 in the high) back to [n, k] unsigned values."""
    v = packed.view(n // INT4_BLOCK_N, k, INT4_BLOCK_N // 2)
    return torch.cat([v & 0xF, v >> 4], dim=-1).permute(0, 2, 1).reshape(n, k)


@functools.cache
def _int4_layout_known() -> bool:
    """The layout _unpack_int4pack reads is torch's private one: checked once, on a small weight."""
    try:
        w = torch.randint(0, 16, (2 * INT4_BLOCK_N, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
        return torch.equal(_unpack_int4pack(packed, *w.shape).to(torch.int32), w)
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def int8_blocks_kernel() -> bool:
    """Whether kernels/cpu_gemv_int8.c and cpu_gemv_int4.c are built here (``int8_blocks``, ``int4_blocks``)."""
    return cpu_native.library() is not None


@functools.cache
def w8a8_kernel() -> bool:
    """Whether kernels/cpu_gemm_w8a8.c is built here (``w8a8``'s per-token quantization and int8 GEMM in one call)."""
    return cpu_native.library() is not None


# What each kind multiplies with, for the worker's log: (at the decode's few rows, above DEQUANTIZE_MIN_ROWS)
_OPS = {"int4": "torch's _weight_int4pack_mm_for_cpu", "int4_blocks": "native int4 GEMV (kernels/cpu_gemv_int4.c)",
        "int8": "torch's _weight_int8pack_mm", "int8_blocks": "native int8 GEMV (kernels/cpu_gemv_int8.c)",
        "int8_grouped": "_weight_int8pack_mm per group", "w8a8": "per-token int8 activations, torch._int_mm"}


def describe_ops(layers: list) -> Optional[str]:
    """One line naming the op each quantized kind in these decoder layers runs, and from how many rows a
    call dequantizes instead (dequantize_min_rows); None where no projection is quantized."""
    kinds = sorted({part.kind for layer in layers for name in ("qkv", "o_proj", "gate_up", "down")
                    if (w := getattr(layer, name, None)) is not None and getattr(w, "quantized", None) is not None
                    for part in w.quantized.parts})

    def above(kind: str) -> str:
        if kind in ("w8a8", "fp8", "fp8_scaled_mm", "gpu_int4", "gpu_int8"):
            return ""
        how = " in one native pass (kernels/cpu_dequantize.c)" if kind in cpu_quantized.DEQUANTIZE_FORMATS else ""
        if _never_copies(kind):
            return f", dequantized{how} in float32 only"
        rows = f", dequantized{how} from {DEQUANTIZE_MIN_ROWS[kind]} rows"
        return rows if dequantize_min_rows(kind, torch.float32) > 1 else rows + " (float32: at every row)"
    def op(kind: str) -> str:
        if kind == "q8_0":
            return (f"native Q8_0 x Q8_0 GEMM in panels of 16 rows, x quantized per block of 32 as llama.cpp does "
                    f"({cpu_quantized.q8_0_variant()}, kernels/cpu_gemm_q8_0.c)")
        if kind == "q5_0":
            return (f"native Q5_0 x Q8_0 GEMM in panels of 16 rows, the weight 5 bits a value, x quantized per block "
                    f"of 32 as llama.cpp does ({cpu_quantized.q8_0_variant()}, kernels/cpu_gemm_q8_0.c)")
        if kind == "w8a8" and w8a8_kernel():
            variant = cpu_quantized.w8a8_variant()
            return f"native int8 GEMM, x quantized per token on entry ({variant}, kernels/cpu_gemm_w8a8.c)"
        if kind in ("gpu_int4", "gpu_int8"):
            return "Triton GEMM, the weight dequantized in registers (kernels/quantized_gemm.py)"
        if kind == "fp8_scaled_mm":
            return "float8 x float8 products in float32, x scaled as the checkpoint's scheme says (torch._scaled_mm)"
        if kind == "fp8":
            how = ("the bytes on the native float8 GEMV (kernels/cpu_gemv_int8.c) up to 47 rows, a dequantized copy "
                   "above" if w8a8_kernel() else "dequantized at load to the model's dtype, its float matmuls")
            return (f"float8 weights: {how}; x rounded through float8 as the checkpoint's activation scheme says "
                    f"(models/fp8_linear.py)")
        if kind == "fp8_blocks":
            return "native float8 GEMV (kernels/cpu_gemv_int8.c, the bytes widened in registers)"
        if kind == "int4_blocks":
            variant = cpu_quantized.gemv_int4_variant()
            how = "; bfloat16 x by vdpbf16ps" if variant == "avx512bf16" else ""
            return f"native int4 GEMV ({variant}{how}, kernels/cpu_gemv_int4.c)"
        return _OPS[kind]
    return "; ".join(f"{kind}: {op(kind)}{above(kind)}" for kind in kinds) if kinds else None


def quantize_per_token(x: torch.Tensor, row_max: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scale [rows, 1]): symmetric, scale = max|row| / 127 (``row_max`` [rows] where given: a
    whole row's), as compressed-tensors' dynamic per-token quantization (a zero row gets scale 1)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) if row_max is None else row_max.reshape(-1, 1).float()) / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(xf / scale).clamp_(-128, 127).to(torch.int8), scale


def quantize_per_block(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, in], float32 d [rows, in / block]): each block of a row scaled to int8 as llama.cpp's Q8_0
    activations are, d = max|block| / 127 and round half to even of x / d (a zero block: values 0, d 0)."""
    rows, k = x.shape
    xf = x.float().view(rows, k // block, block)
    d = xf.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d == 0, 0.0, torch.round(xf / d)).clamp_(-128, 127)
    return q.to(torch.int8).view(rows, k), d.squeeze(-1)


# ---------------------------------------------------------------- builders (from signed integers)


def _pick_group(in_features: int) -> int:
    for g in (256, 128, 64, 32):
        if in_features % g == 0:
            return g
    raise ValueError(f"{in_features} inputs do not divide into int4 groups of 32 or more")


def make_int4(q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: Optional[int],
              dtype: torch.dtype, input_order: Optional[torch.Tensor] = None,
              mins: Optional[torch.Tensor] = None) -> QuantizedLinear:
    """``q`` [out, in] int8 in [-8, 7]; ``scale`` / ``zero_point`` [out, in / group] (or [out, 1]
    per channel, ``group_size`` None); ``input_order``: q's columns are these inputs (QuantizedLinear's);
    ``mins`` [out, in / group] (no zero point): W = scale * (q + 8) - min per group (GGUF's Q4_K)."""
    n, k = q.shape
    if group_size is None:
        group_size = _pick_group(k)
        scale = scale.reshape(n, 1).expand(n, k // group_size)
        if zero_point is not None:
            zero_point = zero_point.reshape(n, 1).expand(n, k // group_size)
    if zero_point is not None and mins is not None:
        raise ValueError("make_int4: a weight has zero points or mins, not both")
    if group_size % cpu_quantized.INT4_CHUNK == 0 and int8_blocks_kernel():
        zeros = None if zero_point is None else (8 + zero_point.to(torch.float32)).contiguous()
        return QuantizedLinear("int4_blocks", n, k, cpu_quantized.pack_int4_blocks((q + 8).to(torch.uint8)),
                               scale.to(torch.float32).contiguous(), group_size, nibble_zeros=zeros,
                               nibble_mins=None if mins is None else mins.to(torch.float32).contiguous(),
                               input_order=input_order)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
    s = scale.to(torch.float32)
    zero = torch.zeros_like(s) if zero_point is None else -zero_point.to(torch.float32) * s
    if mins is not None:  # torch's (nibble - 8) * scale + zero
        zero = 8 * s - mins.to(torch.float32)
    scales_and_zeros = torch.stack([s.t(), zero.t()], dim=-1).to(dtype).contiguous()
    return QuantizedLinear("int4", n, k, packed, scales_and_zeros, group_size, input_order=input_order)


def make_gpu_int(q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: Optional[int],
                 bits: int, device: torch.device, input_order: Optional[torch.Tensor] = None) -> QuantizedLinear:
    """A weight-only layer for a GPU (kernels/quantized_gemm.py, Triton: dequantized in registers): ``q`` [out, in]
    int8 signed values of ``bits``, ``scale`` / ``zero_point`` [out, in / group] or [out, 1] (per channel)."""
    from pagedserve.kernels import quantized_gemm  # imports triton

    n, k = q.shape
    group = group_size or k
    if group != k and not quantized_gemm.block_k_for(group):
        raise UnsupportedModelError(f"groups of {group} inputs are not a multiple of the GPU kernel's "
                                    f"{quantized_gemm.BLOCK_K}")
    stored = quantized_gemm.pack_int4(q) if bits == 4 else q.contiguous()
    zeros = None if zero_point is None else zero_point.to(device, torch.float32).contiguous()
    return QuantizedLinear(f"gpu_int{bits}", n, k, stored.to(device), scale.to(device, torch.float32).contiguous(),
                           group_size=group_size or 0, zero_points=zeros,
                           input_order=None if input_order is None else input_order.to(device))


def make_int8(q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: Optional[int],
              dtype: torch.dtype, input_order: Optional[torch.Tensor] = None, q8_0: bool = False) -> QuantizedLinear:
    """``q`` [out, in] int8; ``scale`` / ``zero_point`` [out, in / group] or [out, 1]; ``input_order`` as make_int4's;
    ``q8_0``: a GGUF Q8_0 matrix, multiplied by x quantized per block of 32 as llama.cpp does (QuantizedLinear's)."""
    n, k = q.shape
    s = scale.to(torch.float32)
    correction = None if zero_point is None else (zero_point.to(torch.float32) * s)
    if group_size is None and zero_point is None and k % 16 == 0 and int8_blocks_kernel():
        group_size, s = k, s.reshape(n, 1)  # per channel: one block a row, on the native GEMV
    if group_size is None:
        return QuantizedLinear("int8", n, k, q.contiguous(), s.reshape(n).to(dtype).contiguous(), 0,
                               None if correction is None else correction.reshape(n).to(dtype), input_order=input_order)
    if zero_point is None and group_size % 16 == 0 and int8_blocks_kernel():
        q8_0 = q8_0 and group_size == cpu_quantized.Q8_0_BLOCK and torch.equal(s.half().float(), s)  # Q8_0's are float16
        if q8_0:
            five = int(q.min()) >= -16 and int(q.max()) <= 15
            pack = cpu_quantized.pack_q5_0_panels if five else cpu_quantized.pack_q8_0_panels
            panels, panel_scales = pack(q.contiguous(), s.half())
            return QuantizedLinear("q5_0" if five else "q8_0", n, k, panels, panel_scales, group_size,
                                   input_order=input_order)
        return QuantizedLinear("int8_blocks", n, k, q.contiguous(), s.contiguous(), group_size, input_order=input_order)
    groups = k // group_size
    weight = q.reshape(n, groups, group_size).transpose(0, 1).contiguous()
    return QuantizedLinear("int8_grouped", n, k, weight, s.t().to(dtype).contiguous(), group_size,
                           None if correction is None else correction.t().to(dtype).contiguous(),
                           input_order=input_order)


def make_w8a8(q: torch.Tensor, scale: torch.Tensor, gate_size: int = 0,
              shard: Optional["TensorParallelShard"] = None) -> QuantizedLinear:
    """``q`` [out, in] int8, ``scale`` [out, 1]: on the native kernel (kernels/cpu_gemm_w8a8.c) where it builds,
    the weight packed in its panels, else torch._int_mm's right operand. ``gate_size``: ``q`` is a gated MLP's
    [gate; up] with no bias, packed for silu_gate() where its gate rows fill whole panels; ``shard``: a row-parallel
    layer's ranks (more than one), whose x is a slice of each row."""
    n, k = q.shape
    if w8a8_kernel():
        gate_size = gate_size if gate_size and gate_size % cpu_quantized.W8A8_PANEL == 0 else 0
        scale = scale.reshape(n).to(torch.float32)
        panels, sums = cpu_quantized.pack_w8a8_weight(q, gate_size)
        if gate_size:
            scale = scale[cpu_quantized.gated_order(gate_size)]
        return QuantizedLinear("w8a8", n, k, panels, scale.contiguous(), w8a8_sums=sums, gate_size=gate_size,
                               shard=shard)
    return QuantizedLinear("w8a8", n, k, q.t().contiguous(), scale.reshape(1, n).to(torch.float32).contiguous(),
                           shard=shard)


# ---------------------------------------------------------------- references (the tests' oracle)


def reference(q: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor], group_size: Optional[int],
              x: torch.Tensor, dynamic_int8: bool = False, q8_0: bool = False) -> torch.Tensor:
    """Plain torch: the dequantized weight (q - zero_point) * scale, then x @ W.T in float32 (W8A8:
    the int8 x int8 products summed exactly in int64, then both scales; ``q8_0``: see q8_0_reference)."""
    n, k = q.shape
    if q8_0:
        return q8_0_reference(q, scale, x).to(x.dtype)
    if dynamic_int8:
        xq, x_scale = quantize_per_token(x)
        acc = xq.to(torch.int64) @ q.to(torch.int64).t()
        return (acc.float() * x_scale * scale.reshape(1, n).float()).to(x.dtype)
    g = group_size or k
    s = scale.float().reshape(n, k // g, 1)
    zp = 0 if zero_point is None else zero_point.float().reshape(n, k // g, 1)
    w = ((q.float().reshape(n, k // g, g) - zp) * s).reshape(n, k)
    return (x.float() @ w.t()).to(x.dtype)


def q8_0_reference(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """llama.cpp's Q8_0 x Q8_0 in float64 (the kernel's float32 sums differ from it by their rounding only): x
    quantized per block (quantize_per_block), each block's int8 products summed exactly, times d_w * d_x."""
    n, k = q.shape
    xq, dx = quantize_per_block(x, block)
    sums = torch.einsum("mbt,nbt->mnb", xq.view(-1, k // block, block).to(torch.int64),
                        q.view(n, k // block, block).to(torch.int64))
    return (sums.double() * scale.double().view(1, n, k // block) * dx.double().unsqueeze(1)).sum(-1)

