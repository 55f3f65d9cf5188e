"""The model's matmuls: F.linear, except on CPU, where the layout that runs fastest is used.

On a CPU with AVX2 and FMA but no AVX-512, the weights are kept only as the panels of the native
kernel (kernels/cpu_linear.c), which every row count takes: on a 2-core Zen 4 it ran the 0.5B and
small shapes' projections 1.4-2.6x as fast as oneDNN's packed weight at one row, 1.05-1.4x at 4-64
rows, and within noise of it at prefill's 256-1024 (bench/log/2026-11-28.md, "CPU: a native linear layer
on AVX2"). Its sums are float32 whatever the weights' dtype: a half-precision checkpoint computed in
float32 keeps half-precision panels (``_narrowest_exact``), and a bfloat16 or float16 model's rows
are widened, multiplied and the result rounded once. Cache-resident models also keep x @ W_t for
one row, which costs less than a call into the kernel there. Elsewhere (AVX-512, where oneDNN's
vectors are twice as wide; no C compiler) the rules below hold. ``PAGEDSERVE_CPU_NATIVE_LINEAR=0``
turns the native kernel off, ``=1`` takes it wherever it is built.

oneDNN's prepacked weights (``torch.ops.mkldnn``) beat oneMKL's sgemm from two rows up on
every weight that streams from memory: 1.1-1.4x per projection and 1.2-1.9x for lm_head on the
0.5B and small shapes, and oneMKL barely gains from a second thread at few rows where oneDNN
doubles (bench/log/2026-11-26.md, "CPU: oneDNN's prepacked weights"). oneDNN costs ~45 us a call more than torch.mm, so:

- models small enough to stay in the caches (<= 16 MiB: the demo, tiny, llama-3layer) keep an
  [in, out] copy and take x @ W_t at every row count (2-4x W @ x.T at 1-32 rows there);
- larger ones take the packed weight from ``PACKED_MIN_ROWS`` rows up. A single row takes
  W @ x.T where the [out, in] weight is kept (models up to 512 MiB; oneDNN is ~2x slower on
  one row of a small weight). Larger models keep only the packed weight, as big as the
  original; on one row it is faster with two threads and ~8% slower with one.

In bfloat16 (where oneDNN has it: AVX-512 up) the packed weight wins at nearly every row count
and size, cache-resident ones too, and alone is kept. Two threads, against torch's unpacked bf16
matmul (oneDNN's too): 1.3-2.4x at 1-8 rows (lm_head 10.1 -> 7.7 ms at one row; 18.1 -> 7.7 on
one thread), 1.25-1.5x at 32, 1.02-1.18x at 256-1024. Only down_proj at 32 rows (W @ x.T, ~10%)
and lm_head at 256 rows on one thread (5%) went the other way (bench/log/2026-11-26.md, "CPU: bf16 on
AVX512-BF16"). Measured with AVX512-BF16 (oneDNN's ``brg_matmul:avx512_core_bf16``); on AMX oneDNN
picks its AMX brgemm behind the same call, so the rule is the same there, unmeasured. float16
keeps the unpacked paths.

**Decode's few rows on AVX512-BF16, in bfloat16** take kernels/cpu_gemv.c: 1-4 rows its vdpbf16ps panels
(``gemv_panels``, [N/16][K/2][16][2], one sequential stream per thread), which read a one-stream step's
0.988 GB on one core at ~90% of that core's read bandwidth where oneDNN's packed weight read it at ~80%
(bench/RESULTS.md, "CPU: one stream at the memory's speed"); at 5-8 rows the panels' broadcasts of x
cost more than oneDNN's packed call, which takes them and everything above (prefill, many streams), for
models of up to ``GEMV_TWO_LAYOUTS_MAX_BYTES``; larger ones keep one copy, oneDNN's packed weight, for
every row count (two would not fit: issue 52's 15.5 GB MoE on a 23 GiB machine), or, without it, the
weight as loaded: the row-major GEMV at 5-8 rows, F.linear above. ``PAGEDSERVE_CPU_GEMV=0`` turns it off,
``=1`` takes the row-major GEMV (up to 8 rows) in every dtype the kernel serves (float32 and float16
widened, not measured as faster).

``PAGEDSERVE_CPU_PACKED_LINEAR=0`` keeps the unpacked paths everywhere (``W @ x.T`` up to 32
rows, an [in, out] copy above for models up to 512 MiB, F.linear above for larger ones), ``=1``
packs cache-resident models' float32 weights too. Every path here sums dot products in its own
order, so results may differ from F.linear in the last bits; greedy parity with transformers is
checked by tests/unit/test_model_parity.py and the bench's identical-output count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from pagedserve.runtime.cpu_dtype import cpu_flags
from pagedserve.worker_proc.env_switch import env_switch

if TYPE_CHECKING:
    from pagedserve.worker_proc.elementwise import Elementwise
    from pagedserve.worker_proc.models.quantized_linear import QuantizedLinear

# W @ x.T won over F.linear at 16 and 32 rows on the small and 0.5B shapes, and lost at 64.
SMALL_BATCH_ROWS = 32
# Weights (all of them, lm_head included) up to this size also keep a second layout on CPU.
TRANSPOSED_COPY_MAX_BYTES = 512 << 20
# Up to this size they stay in the caches from step to step, where x @ W_t is 2-4x faster than
# W @ x.T at every row count (demo model, 1-32 rows).
CACHE_RESIDENT_MAX_BYTES = 16 << 20
# From two rows oneDNN's packed weight wins (896x1152: 210 against 231 us).
PACKED_MIN_ROWS = 2
PACKED_ENV = "PAGEDSERVE_CPU_PACKED_LINEAR"
NATIVE_ENV = "PAGEDSERVE_CPU_NATIVE_LINEAR"
GEMV_ENV = "PAGEDSERVE_CPU_GEMV"
# cpu_gemv.c takes products of up to this many rows; its bfloat16 panels up to GEMV_PANEL_MAX_ROWS (faster than
# oneDNN's packed weight at 1-4 rows, slower at 8: bench/RESULTS.md).
GEMV_MAX_ROWS = cpu_native.GEMV_MAX_ROWS
GEMV_PANEL_MAX_ROWS = 4
# Up to this size a model keeps oneDNN's packed copy beside the weight cpu_gemv.c reads (both in memory).
GEMV_TWO_LAYOUTS_MAX_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """How a model's matrices are kept on CPU (chosen once per model by its size)."""
    transposed: bool = False  # an [in, out] copy beside each [out, in] weight
    resident: bool = False  # small enough to stay cached: the copy serves every row count
    packed: bool = False  # a oneDNN prepacked copy serves PACKED_MIN_ROWS rows and up
    plain: bool = True  # the [out, in] weight itself is kept (False: only the packed copy or panels)
    native: bool = False  # cpu_linear.c's panels serve every row count (resident: all but one row)
    gemv: bool = False  # cpu_gemv.c serves few rows: from its bfloat16 panels, or the [out, in] weight (plain)


@dataclass(slots=True)
class LinearWeight:
    weight: Optional[torch.Tensor]  # [out, in], contiguous; None when only `packed` or `panels` is kept
    bias: Optional[torch.Tensor] = None  # [out]
    weight_t: Optional[torch.Tensor] = None  # [in, out] contiguous copy (CPU, small models)
    resident: bool = False  # use weight_t for few rows too
    packed: Optional[torch.Tensor] = None  # oneDNN's blocked layout of weight (CPU)
    panels: Optional[torch.Tensor] = None  # cpu_linear.c's layout of weight: [ceil(out / 16), in, 16]
    out_features: int = 0
    gate_size: int = 0  # a gate_up weight's gate rows (its panels, if any, alternate gate and up: silu_gate only)
    quantized: Optional["QuantizedLinear"] = None  # a quantized checkpoint's layer: its integers, scales and op
    gemv: bool = False  # few rows take cpu_gemv.c: gemv_panels up to GEMV_PANEL_MAX_ROWS, else ``weight``
    gemv_panels: Optional[torch.Tensor] = None  # cpu_gemv.c's bfloat16 panels [ceil(out / 16), ceil(in / 2), 16, 2]

    @classmethod
    def of(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], layout: WeightLayout,
           gate_size: int = 0) -> "LinearWeight":
        """``gate_size``: ``weight`` is a gated MLP's gate_up ([gate; up], gate_size rows each),
        multiplied only by silu_gate()."""
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if layout.packed else None
        panels = None
        if layout.native:
            narrow = _narrowest_exact(weight)
            panels = (cpu_native.pack_silu_gate_weight(narrow, gate_size) if gate_size
                      else cpu_native.pack_linear_weight(narrow))
        return cls(weight if layout.plain else None, bias,
                   weight.t().contiguous() if layout.transposed else None, layout.resident, packed, panels,
                   weight.shape[0], gate_size, gemv=layout.gemv,
                   gemv_panels=cpu_native.pack_gemv_panels(weight) if layout.gemv and _panels_for(weight.dtype) else None)


def _panels_for(dtype: torch.dtype) -> bool:
    """cpu_gemv.c's panels serve this dtype's few rows by default (bfloat16 on AVX512-BF16); not under
    ``PAGEDSERVE_CPU_GEMV=1``, which asks for the row-major kernel."""
    return dtype == torch.bfloat16 and env_switch(GEMV_ENV) is None and cpu_native.supports_gemv_panels()


def _narrowest_exact(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight whose every value is a bfloat16 or a float16 (a half-precision checkpoint
    computed in float32) is kept in that dtype: the kernel widens it exactly, so the products are
    the same from half the bytes a step streams."""
    if weight.dtype == torch.float32:
        for half in (torch.bfloat16, torch.float16):
            head = weight.reshape(-1)[:4096]  # a float32 checkpoint fails here, without a full pass
            if not torch.equal(head.to(half).float(), head):
                continue
            narrow = weight.to(half)
            if torch.equal(narrow.float(), weight):
                return narrow
    return weight


def packed_linear_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear, in a dtype it was measured in: float32, and bfloat16 where
    oneDNN computes it (without AVX-512 it would take oneDNN's reference loops)."""
    if dtype == torch.bfloat16:
        return _onednn_bfloat16() and _packed_linear_works(dtype)
    return dtype == torch.float32 and _packed_linear_works(dtype)


def _onednn_bfloat16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _packed_linear_works(dtype: torch.dtype = torch.float32) -> bool:
    """The ops are private to torch: one small product, checked, before any model relies on them
    (small integers: exact in bfloat16 too)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.arange(12.0, dtype=dtype).reshape(4, 3), torch.ones(2, 3, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out.dtype == dtype and torch.equal(out, F.linear(x, weight))
    except (AttributeError, RuntimeError, TypeError):
        return False


def native_linear_chosen(dtype: torch.dtype = torch.float32) -> bool:
    """Whether weights take cpu_linear.c's panels: where the kernel is built, by default on CPUs
    without AVX-512 (the ones it was measured on); float32, bfloat16 and float16 models alike
    (half-precision rows are multiplied in float32 and the result rounded once)."""
    choice = env_switch(NATIVE_ENV)
    if dtype not in cpu_native.DTYPE_SUFFIXES or choice is False or not cpu_native.supports_linear():
        return False
    return choice or "avx512f" not in cpu_flags()


def gemv_chosen(dtype: torch.dtype) -> bool:
    """Whether a few rows take cpu_gemv.c: where it is built, by default in bfloat16 with AVX512-BF16
    (the one measured faster than oneDNN), with ``PAGEDSERVE_CPU_GEMV=1`` in every dtype it takes."""
    choice = env_switch(GEMV_ENV)
    if dtype not in cpu_native.DTYPE_SUFFIXES or choice is False or cpu_native.library() is None:
        return False
    return choice or (dtype == torch.bfloat16 and cpu_native.gemv_variant() == "avx512bf16")


def weight_layout(device: torch.device, weight_bytes: int, dtype: torch.dtype = torch.float32) -> WeightLayout:
    """How a model of ``weight_bytes`` of weights keeps its matrices."""
    if device.type != "cpu":
        return WeightLayout()
    if gemv_chosen(dtype):  # cpu_gemv.c for few rows (panels or the weight as loaded); oneDNN packed beside
        packed_ok = env_switch(PACKED_ENV) is not False and packed_linear_available(dtype)
        if weight_bytes > GEMV_TWO_LAYOUTS_MAX_BYTES and packed_ok and _panels_for(dtype):
            # the panels beside any second layout are two copies: a 15.5 GB MoE was killed for memory on a
            # 23 GiB machine (bench/log/2026-12-07.md, third session); oneDNN's packed weight alone serves
            # every row count, ~10% slower than the panels at one row
            return WeightLayout(packed=True, plain=False)
        packed = weight_bytes <= GEMV_TWO_LAYOUTS_MAX_BYTES and packed_ok
        plain = not packed or not _panels_for(dtype)  # the row-major GEMV and F.linear's weight where needed
        return WeightLayout(packed=packed, plain=plain, gemv=True)
    resident = weight_bytes <= CACHE_RESIDENT_MAX_BYTES
    if native_linear_chosen(dtype):
        return WeightLayout(transposed=resident, resident=resident, plain=False, native=True)
    choice = env_switch(PACKED_ENV)
    if dtype == torch.bfloat16 and choice is not False and packed_linear_available(dtype):
        return WeightLayout(packed=True, plain=False)  # fastest at every size and row count
    packed = (not resident if choice is None else choice) and packed_linear_available(dtype)
    if weight_bytes > TRANSPOSED_COPY_MAX_BYTES:
        return WeightLayout(packed=packed, plain=not packed)
    return WeightLayout(transposed=not packed or resident, resident=resident, packed=packed)


def _on_panels(x: torch.Tensor, w: LinearWeight) -> bool:
    """Whether the native kernel takes this product: its panels exist, and the row is not one
    that W @ x.T serves from weight_t (one row of a weight kept in both layouts)."""
    return w.panels is not None and (x.shape[0] > 1 or w.weight_t is None)


def _in_float32(kernel, x: torch.Tensor, *args) -> torch.Tensor:
    """The native kernels take and give float32 rows; half-precision rows widen and round once."""
    if x.dtype == torch.float32:
        return kernel(x, *args)
    return kernel(x.float(), *args).to(x.dtype)


def silu_gate(x: torch.Tensor, w: LinearWeight, ew: "Elementwise") -> torch.Tensor:
    """A gated MLP's input to down_proj, silu(gate) * up, from its gate_up weight: in one native
    call where the panels alternate gate and up (the [rows, 2 * size] product never reaches
    memory: a 0.5B prefill layer's MLP 101 -> 96 ms at 845 rows, bench/log/2026-11-28.md "CPU: huge
    pages and a fused SiLU gate"), else linear() then ``ew.silu_mul``. ``w``: made with gate_size."""
    if _on_panels(x, w):
        return _in_float32(cpu_native.silu_gate, x, w.panels, w.gate_size, w.bias)
    if w.quantized is not None and w.quantized.gate_size:  # a W8A8 gate_up: the gate in the GEMM's epilogue
        return w.quantized.silu_gate(x)
    return ew.silu_mul(linear(x, w), w.gate_size)


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias): [rows, out], contiguous."""
    if w.quantized is not None:  # models/quantized_linear.py
        out = w.quantized.forward(x)
        return out if w.bias is None else out.add_(w.bias)
    if x.device.type != "cpu":
        return F.linear(x, w.weight, w.bias)
    rows = x.shape[0]
    if w.gemv and rows <= GEMV_MAX_ROWS:
        if w.gemv_panels is not None and rows <= GEMV_PANEL_MAX_ROWS:
            return cpu_native.gemv_panels(x, w.gemv_panels, w.out_features, w.bias)
        if w.weight is not None:
            return cpu_native.gemv(x, w.weight, w.bias)
    if _on_panels(x, w):
        if w.gate_size:  # its panels alternate gate and up
            raise ValueError("a gate_up weight packed for silu_gate multiplies only through it")
        return _in_float32(cpu_native.linear, x, w.panels, w.out_features, w.bias)
    if w.packed is not None and (rows >= PACKED_MIN_ROWS or w.weight is None):
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, w.bias, "none", [], "")
    if rows <= SMALL_BATCH_ROWS and not w.resident:
        out = torch.mm(w.weight, x.t()).t().contiguous()
        return out if w.bias is None else out.add_(w.bias)
    if w.weight_t is not None:
        return torch.mm(x, w.weight_t) if w.bias is None else torch.addmm(w.bias, x, w.weight_t)
    return F.linear(x, w.weight, w.bias)
