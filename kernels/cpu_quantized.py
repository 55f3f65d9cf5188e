"""The integer weights' CPU kernels (cpu_gemv_int8.c, cpu_gemm_q8_0.c, cpu_gemv_int4.c, cpu_gemm_w8a8.c, and
cpu_dequantize.c's copies): each weight layout
they read, its packing and unpacking, and the call.

A quantized checkpoint's matrices (worker_proc/models/quantized_linear.py) are kept in these layouts: int8 with
a scale per block of inputs (W8A16, GGUF Q6_K), GGUF Q8_0 and Q5_0 in panels of 16 rows (llama.cpp's arithmetic,
x quantized per block of 32, on VNNI; Q5_0 at its file's 5 bits), int4 nibbles in runs of 32 (W4A16, GPTQ, AWQ, GGUF Q4_0/Q4_1/Q4_K),
and W8A8's int8 panels for VNNI. The library itself, its build and its symbols' signatures are cpu_native.py's.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.cpu_native import DTYPE_SUFFIXES, GEMV_MAX_ROWS, GEMV_OUT_KIND


def gemv_int8_blocks(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                     out_dtype: Optional[torch.dtype] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [M, K] (M >= 1, GEMV_MAX_ROWS at a time; float32, bfloat16 or float16) @ (q [N, K] int8 * scales
    [N, K / block] float32, one per block of inputs).T: [M, N] in ``out_dtype`` (default x's), float32 sums
    (kernels/cpu_gemv_int8.c). ``block`` a multiple of the vector width (16 suffices everywhere) dividing K.
    ``q`` float8_e4m3fn: its values, each scale times FP8_SCALE_FACTOR (fp8_block_scales)."""
    rows, k = x.shape
    n = q.shape[0]
    if (q.dtype not in (torch.int8, torch.float8_e4m3fn) or q.shape != (n, k) or scales.dtype != torch.float32
            or block % 16 or k % block or scales.shape != (n, k // block) or rows < 1):
        raise ValueError("gemv_int8_blocks: x, the weight and its scales do not match")
    xf = x.float().contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
    lib = lib or cpu_native.library()
    kernel = lib.gemv_int8_blocks if q.dtype == torch.int8 else lib.gemv_fp8_blocks
    if kernel(xf.data_ptr(), k, rows, k, q.contiguous().data_ptr(), scales.contiguous().data_ptr(), block, n,
              out.data_ptr(), n, GEMV_OUT_KIND[out.dtype]):
        raise ValueError("gemv_int8_blocks: the kernel refused the shapes")
    return out


# kernels/cpu_gemv_int8.c widens a float8_e4m3fn byte to 2^-120 times its value (its bits moved into float32's):
# the scales it multiplies by carry the 2^120
FP8_SCALE_FACTOR = 2.0 ** 120


def fp8_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """A float8 weight's scales [N, K / block] as gemv_int8_blocks takes them with the float8 values."""
    return (scales.to(torch.float32) * FP8_SCALE_FACTOR).contiguous()


Q8_0_BLOCK = 32  # cpu_gemm_q8_0.c: the inputs of a weight block and of an activation block


def q8_0_variant(lib: Optional[ctypes.CDLL] = None) -> Optional[str]:
    """Which instructions gemm_q8_0_panels() and gemm_q5_0_panels() multiply with here ("avx512vnni", "portable");
    None without the library."""
    lib = lib or cpu_native.library()
    return None if lib is None else lib.q8_0_variant().decode()


Q8_0_PANEL = 16  # the rows of a Q8_0 or Q5_0 panel (kernels/cpu_q8_0_panels.h)


def pack_q8_0_panels(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's values [N, K] int8 and float16 scales [N, K / 32] -> gemm_q8_0_panels()'s layout: the values + 128
    [ceil(N / 16), K / 32, 8, 16, 4] uint8 (per panel of 16 rows and block of 32 inputs, run t the rows' inputs
    4t .. 4t + 3; zero values past N) and the scales [ceil(N / 16), K / 32, 16] float16 (0 past N)."""
    n, k = q.shape
    if k % Q8_0_BLOCK or q.dtype != torch.int8 or scales.shape != (n, k // Q8_0_BLOCK) or scales.dtype != torch.float16:
        raise ValueError(f"pack_q8_0_panels: {k} int8 inputs are not whole blocks of {Q8_0_BLOCK} with their scales")
    rows = -(-n // Q8_0_PANEL) * Q8_0_PANEL
    u = torch.full((rows, k), 128, dtype=torch.uint8)
    u[:n] = (q.to(torch.int16) + 128).to(torch.uint8)
    s = torch.zeros(rows, k // Q8_0_BLOCK, dtype=torch.float16)
    s[:n] = scales
    panels = u.view(rows // Q8_0_PANEL, Q8_0_PANEL, k // Q8_0_BLOCK, Q8_0_BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    return panels.contiguous(), s.view(rows // Q8_0_PANEL, Q8_0_PANEL, -1).transpose(1, 2).contiguous()


def unpack_q8_0_panels(panels: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q8_0_panels' inverse: the first ``n`` rows' values [n, K] int8 and scales [n, K / 32] float16."""
    p, blocks = panels.shape[:2]
    q = panels.permute(0, 3, 1, 2, 4).reshape(p * Q8_0_PANEL, blocks * Q8_0_BLOCK)[:n]
    return (q.to(torch.int16) - 128).to(torch.int8), scales.transpose(1, 2).reshape(p * Q8_0_PANEL, blocks)[:n]


def pack_q5_0_panels(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q5_0 matrix's values [N, K] (int8 in [-16, 15]) and float16 scales [N, K / 32] -> gemm_q5_0_panels()'s
    layout (kernels/cpu_q8_0_panels.h): per panel of 16 rows and block of 32 inputs, of u = q + 16 in pack_q8_0_panels'
    runs, the runs' nibbles in pairs (byte i of a pair: the even run's value i low, the odd run's high) then each
    run's fifth bits (bit i, little-endian: value i's), [ceil(N / 16), K / 32, 320] uint8; the scales as
    pack_q8_0_panels'."""
    n, k = q.shape
    if q.dtype != torch.int8 or (q.numel() and (int(q.min()) < -16 or int(q.max()) > 15)):
        raise ValueError("pack_q5_0_panels: the values are not 5-bit integers")
    runs, panel_scales = pack_q8_0_panels(q, scales)  # + 128: back to u = q + 16 below
    u = (runs - 112).view(runs.shape[0], k // Q8_0_BLOCK, Q8_0_BLOCK // 4, Q8_0_PANEL * 4)
    nibbles = (u[:, :, 0::2] & 15) | ((u[:, :, 1::2] & 15) << 4)
    fifth = ((u >> 4).view(*u.shape[:3], 8, 8) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return torch.cat([nibbles.flatten(2), fifth.flatten(2)], dim=-1).contiguous(), panel_scales


def unpack_q5_0_panels(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q5_0_panels' inverse: the first ``n`` rows' values [n, K] int8 and scales [n, K / 32] float16."""
    p, blocks = packed.shape[:2]
    pairs = packed[..., :_Q5_NIBBLE_BYTES].reshape(p, blocks, Q8_0_BLOCK // 8, 1, Q8_0_PANEL * 4)
    low4 = torch.cat([pairs & 15, pairs >> 4], dim=3).flatten(2, 3)  # [p, blocks, runs, 64]
    bits = packed[..., _Q5_NIBBLE_BYTES:].reshape(p, blocks, Q8_0_BLOCK // 4, 8, 1)
    fifth = ((bits >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(3)
    runs = ((low4 | (fifth << 4)) + 112).view(p, blocks, Q8_0_BLOCK // 4, Q8_0_PANEL, 4)  # as Q8_0's: + 128
    return unpack_q8_0_panels(runs, scales, n)


_Q5_NIBBLE_BYTES = Q8_0_PANEL * Q8_0_BLOCK // 2  # a Q5_0 panel's block: 256 bytes of nibbles, then 64 of fifth bits
_Q5_BLOCK_BYTES = _Q5_NIBBLE_BYTES + Q8_0_PANEL * Q8_0_BLOCK // 8


def gemm_q8_0_panels(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, n: int,
                     out_dtype: Optional[torch.dtype] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """llama.cpp's Q8_0 x Q8_0 (x quantized per block of 32, d = max|x| / 127, round half to even; each block's int8
    products summed exactly) on the weight packed by pack_q8_0_panels, any number of rows of x (float32, bfloat16 or
    float16; rows may be strided), the blocks' scaled sums added in order in float32:
    out = (...(isum_0 * (dw_0 * dx_0)) + isum_1 * (dw_1 * dx_1)) + ...): [M, n] in ``out_dtype`` (default x's)
    (kernels/cpu_gemm_q8_0.c)."""
    return _gemm_panels("gemm_q8_0_panels", x, panels, (Q8_0_BLOCK // 4, Q8_0_PANEL, 4), scales, n, out_dtype, lib)


def gemm_q5_0_panels(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int,
                     out_dtype: Optional[torch.dtype] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """gemm_q8_0_panels on a Q5_0 weight packed by pack_q5_0_panels (0.625 bytes a value against 1): the same
    outputs, bit for bit, as gemm_q8_0_panels on its values."""
    return _gemm_panels("gemm_q5_0_panels", x, packed, (_Q5_BLOCK_BYTES,), scales, n, out_dtype, lib)


def _gemm_panels(name: str, x: torch.Tensor, w: torch.Tensor, block_shape: tuple, scales: torch.Tensor, n: int,
                 out_dtype: Optional[torch.dtype], lib: Optional[ctypes.CDLL]) -> torch.Tensor:
    rows, k = x.shape
    blocks, p = k // Q8_0_BLOCK, -(-n // Q8_0_PANEL)
    if (x.dtype not in DTYPE_SUFFIXES or w.dtype != torch.uint8 or k % Q8_0_BLOCK or rows < 1 or n < 1
            or w.shape != (p, blocks, *block_shape) or scales.dtype != torch.float16
            or scales.shape != (p, blocks, Q8_0_PANEL)):
        raise ValueError(f"{name}: x, the weight and its scales do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
    if getattr(lib or cpu_native.library(), name)(x.data_ptr(), _W8A8_KIND[x.dtype], x.stride(0), rows, k,
                                                  w.contiguous().data_ptr(), scales.contiguous().data_ptr(), n,
                                                  out.data_ptr(), n, GEMV_OUT_KIND[out.dtype]):
        raise MemoryError(f"{name}: no memory for the kernel's scratch")
    return out


INT4_CHUNK = 32  # cpu_gemv_int4.c: inputs whose nibbles share one 16-byte run (low: the first 16, high: the next)


def pack_int4_blocks(unsigned: torch.Tensor) -> torch.Tensor:
    """Nibbles [N, K] (0..15, K a multiple of 32) -> gemv_int4_blocks()'s layout [N, K / 2] uint8: per 32
    inputs, byte i holds input i in its low nibble and input 16 + i in its high one (GGUF Q4_0's payload)."""
    n, k = unsigned.shape
    if k % INT4_CHUNK:
        raise ValueError(f"pack_int4_blocks: {k} inputs are not whole runs of {INT4_CHUNK}")
    v = unsigned.to(torch.uint8).view(n, k // INT4_CHUNK, 2, INT4_CHUNK // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4_blocks(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4_blocks' inverse: [N, K] uint8 nibbles."""
    n, half = packed.shape
    v = packed.view(n, half // (INT4_CHUNK // 2), 1, INT4_CHUNK // 2)
    return torch.cat([v & 0xF, v >> 4], dim=2).reshape(n, 2 * half)


def gemv_int4_blocks(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     group: int, out_dtype: Optional[torch.dtype] = None, lib: Optional[ctypes.CDLL] = None,
                     mins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (M >= 1, GEMV_MAX_ROWS at a time; float32, bfloat16 or float16) @ W.T, W[j, t] = (nibble -
    z) * scale per group of ``group`` inputs (a multiple of 32 dividing K): ``packed`` [N, K / 2] uint8
    (pack_int4_blocks), ``scales`` [N, K / group] float32, ``zeros`` None (z = 8, symmetric) or [N, K / group]
    float32 (8 + zero point); or, ``mins`` [N, K / group] float32 given (zeros None), W = scale * nibble - min
    (GGUF's Q4_K). [M, N] in ``out_dtype`` (default x's), float32 sums (kernels/cpu_gemv_int4.c; bfloat16 x by
    vdpbf16ps where gemv_int4_variant() says avx512bf16)."""
    rows, k = x.shape
    n = packed.shape[0]
    if group <= 0 or group % INT4_CHUNK or k % group:
        raise ValueError(f"gemv_int4_blocks: groups of {group} do not tile {k} inputs in runs of {INT4_CHUNK}")
    groups = (n, k // group)
    if (packed.dtype != torch.uint8 or packed.shape != (n, k // 2) or scales.dtype != torch.float32
            or scales.shape != groups or rows < 1 or x.dtype not in GEMV_OUT_KIND
            or any(t is not None and (t.dtype != torch.float32 or t.shape != groups) for t in (zeros, mins))
            or (zeros is not None and mins is not None)):
        raise ValueError("gemv_int4_blocks: x, the weight and its scales do not match")
    x = x.contiguous()  # read in its own dtype: the kernel widens (or, bfloat16, multiplies) it
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
    status = (lib or cpu_native.library()).gemv_int4_blocks(x.data_ptr(), GEMV_OUT_KIND[x.dtype], k, rows, k,
                                                 packed.contiguous().data_ptr(), scales.contiguous().data_ptr(),
                                                 None if zeros is None else zeros.contiguous().data_ptr(),
                                                 None if mins is None else mins.contiguous().data_ptr(), group, n,
                                                 out.data_ptr(), n, GEMV_OUT_KIND[out.dtype])
    if status == -2:
        raise MemoryError("gemv_int4_blocks: no memory for x's copy")
    if status:
        raise ValueError("gemv_int4_blocks: the kernel refused the shapes")
    return out


def gemv_int4_variant(lib: Optional[ctypes.CDLL] = None) -> Optional[str]:
    """How gemv_int4_blocks() multiplies here: "avx512bf16" (bfloat16 x by vdpbf16ps; other dtypes as "avx512"),
    "avx512" (a 16-entry table of a group's float32 weights), "avx2" or "scalar"; None without the library."""
    lib = lib or cpu_native.library()
    return None if lib is None else lib.gemv_int4_variant().decode()


# dequantize()'s formats, as cpu_dequantize.c numbers them: each a QuantizedLinear kind, and its packed weight's shape
DEQUANTIZE_FORMATS = {"int8_blocks": 0, "q8_0": 1, "q5_0": 2, "int4_blocks": 3, "fp8_blocks": 4}


def _packed_shapes(kind: str, n: int, k: int, group: int) -> tuple[tuple, tuple]:
    """A ``kind`` weight of [n, k]'s packed shape and its scales'."""
    panels = (-(-n // Q8_0_PANEL), k // Q8_0_BLOCK)
    if kind == "q8_0":
        return (*panels, Q8_0_BLOCK // 4, Q8_0_PANEL, 4), (*panels, Q8_0_PANEL)
    if kind == "q5_0":
        return (*panels, _Q5_BLOCK_BYTES), (*panels, Q8_0_PANEL)
    return {"int8_blocks": (n, k), "fp8_blocks": (n, k), "int4_blocks": (n, k // 2)}[kind], (n, k // group)


def dequantize(kind: str, weight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int,
               dtype: torch.dtype, zeros: Optional[torch.Tensor] = None, mins: Optional[torch.Tensor] = None,
               lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """A packed weight of ``kind`` (DEQUANTIZE_FORMATS: the layouts above) as [n, k] ``dtype``, the values torch's
    ops make from its integers (q * scale, or (nibble - z) * scale, or nibble * scale - min, in float32, then one
    rounding), in one pass (kernels/cpu_dequantize.c). ``scales`` [n, k / group] float32 (Q8_0's and Q5_0's: float16
    in panels, as pack_q8_0_panels makes them); ``zeros`` (8 + zero point) or ``mins`` [n, k / group] float32, int4_blocks only."""
    groups = (n, k // group) if group > 0 and k % group == 0 else None
    shapes = _packed_shapes(kind, n, k, group) if kind in DEQUANTIZE_FORMATS and groups else None
    if (shapes is None or (tuple(weight.shape), tuple(scales.shape)) != shapes
            or scales.dtype not in (torch.float32, torch.float16) or dtype not in GEMV_OUT_KIND
            or any(t is not None and (t.dtype != torch.float32 or t.shape != groups) for t in (zeros, mins))):
        raise ValueError(f"dequantize: a {kind} weight of [{n}, {k}] in groups of {group} does not match its tensors")
    out = torch.empty(n, k, dtype=dtype)
    status = (lib or cpu_native.library()).dequantize_weight(
        DEQUANTIZE_FORMATS[kind], weight.contiguous().data_ptr(), scales.contiguous().data_ptr(),
        int(scales.dtype == torch.float16), None if zeros is None else zeros.contiguous().data_ptr(),
        None if mins is None else mins.contiguous().data_ptr(), group, n, k, out.data_ptr(), GEMV_OUT_KIND[dtype])
    if status == -2:
        raise MemoryError("dequantize: no memory for a row buffer")
    if status:
        raise ValueError(f"dequantize: the kernel refused a {kind} weight of [{n}, {k}] in groups of {group}")
    return out


W8A8_PANEL = 16  # cpu_gemm_w8a8.c: a packed W8A8 weight's output columns per panel, 4 inputs per int32 lane
# x's and the result's dtype as cpu_gemm_w8a8.c names them (out_kind 3: the int32 sums, for the tests)
_W8A8_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int32: 3}


def w8a8_variant(lib: Optional[ctypes.CDLL] = None) -> Optional[str]:
    """Which instructions w8a8_linear() multiplies with here ("avx512vnni", "avx2", "scalar"); None without the
    library."""
    lib = lib or cpu_native.library()
    return None if lib is None else lib.w8a8_variant().decode()


def pack_w8a8_weight(q: torch.Tensor, gate_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight [N, K] -> (w8a8_linear()'s panels [ceil(N / 16), ceil(K / 4), 16, 4] int8, zero past N and
    K: a panel's 16 columns with 4 consecutive inputs each in one int32 lane; 128 * each padded column's sum
    [ceil(N / 16) * 16] int32, what the VNNI variant's unsigned activations (xq + 128) add). ``gate_size``: ``q``
    is a gated MLP's [gate; up] (N = 2 * gate_size, gate_size a multiple of 16), packed for w8a8_silu_gate with
    its columns in ``gated_order`` (16 of gate, 16 of up, ...)."""
    if gate_size:
        q = q[gated_order(gate_size)]
    n, k = q.shape
    padded = torch.zeros(-(-n // W8A8_PANEL) * W8A8_PANEL, -(-k // 4) * 4, dtype=torch.int8)
    padded[:n, :k] = q
    panels = padded.view(-1, W8A8_PANEL, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return panels, (padded.sum(1, dtype=torch.int32) * 128).contiguous()


def gated_order(gate_size: int) -> torch.Tensor:
    """A [gate; up] weight's rows in w8a8_silu_gate's packed order: 16 gate rows, the 16 up rows of the same
    outputs, and so on (one column block of cpu_gemm_w8a8.c holds both halves of its outputs)."""
    if gate_size % W8A8_PANEL:
        raise ValueError(f"a W8A8 gate_up packs for silu_gate in panels of {W8A8_PANEL} (gate size {gate_size})")
    rows = torch.arange(2 * gate_size).view(2, -1, W8A8_PANEL)
    return rows.transpose(0, 1).reshape(-1)


def _w8a8_checked(x: torch.Tensor, panels: torch.Tensor, bias128: torch.Tensor, w_scale: torch.Tensor,
                  columns: int, name: str) -> torch.Tensor:
    """x with unit column stride, once x, the panels and the scales are known to match (``columns``: the packed
    product's)."""
    rows, k = x.shape
    if (x.dtype not in DTYPE_SUFFIXES or panels.dtype != torch.int8 or panels.shape[1:] != (-(-k // 4), W8A8_PANEL, 4)
            or panels.shape[0] * W8A8_PANEL < columns or bias128.shape != (panels.shape[0] * W8A8_PANEL,)
            or w_scale.shape != (columns,) or w_scale.dtype != torch.float32 or rows < 1):
        raise ValueError(f"{name}: x, the packed weight and its scales do not match")
    return x if x.stride(1) == 1 else x.contiguous()


def w8a8_linear(x: torch.Tensor, panels: torch.Tensor, bias128: torch.Tensor, w_scale: torch.Tensor,
                out_features: int, out_dtype: Optional[torch.dtype] = None, x_scale_out: Optional[torch.Tensor] = None,
                lib: Optional[ctypes.CDLL] = None, x_absmax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16; rows may be strided), each row quantized to int8 per token
    (quantize_per_token's scale and rounding) @ the int8 weight packed by pack_w8a8_weight, the products summed
    exactly in int32, times both scales (``w_scale`` [N] float32): [M, N] in ``out_dtype`` (default x's; int32
    gives the sums themselves). ``x_scale_out`` [M] float32, where given, receives the rows' scales; ``x_absmax``
    [M] float32, where given, is each row's max |x| to scale by (a tensor-parallel rank's x is a slice of its rows)
    (kernels/cpu_gemm_w8a8.c)."""
    x = _w8a8_checked(x, panels, bias128, w_scale, out_features, "w8a8_linear")
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=out_dtype or x.dtype)
    for name, t in (("x_scale_out", x_scale_out), ("x_absmax", x_absmax)):
        if t is not None and (t.numel() != rows or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"w8a8_linear: {name} must be [M] float32")
    lib = lib or cpu_native.library()
    if lib.w8a8_linear(x.data_ptr(), _W8A8_KIND[x.dtype], x.stride(0), rows, k, panels.data_ptr(),
                       bias128.data_ptr(), w_scale.data_ptr(), out_features, out.data_ptr(),
                       out_features, _W8A8_KIND[out.dtype], None if x_scale_out is None else x_scale_out.data_ptr(),
                       None if x_absmax is None else x_absmax.data_ptr()):
        raise MemoryError("w8a8_linear: the kernel refused the shapes or had no memory for its scratch")
    return out


def w8a8_silu_gate(x: torch.Tensor, panels: torch.Tensor, bias128: torch.Tensor, w_scale: torch.Tensor,
                   gate_size: int, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a [gate; up] packed by pack_w8a8_weight(q, gate_size) (``w_scale`` [2 *
    gate_size] in the same ``gated_order``), x quantized as w8a8_linear's: [M, gate_size] in x's dtype, the
    values of w8a8_linear then cpu_native.silu_mul, rounded where they round."""
    x = _w8a8_checked(x, panels, bias128, w_scale, 2 * gate_size, "w8a8_silu_gate")
    if gate_size % W8A8_PANEL or panels.shape[0] * W8A8_PANEL != 2 * gate_size:
        raise ValueError(f"w8a8_silu_gate: the panels hold no gate_up of gate size {gate_size}")
    rows, k = x.shape
    out = torch.empty(rows, gate_size, dtype=x.dtype)
    lib = lib or cpu_native.library()
    if lib.w8a8_silu_gate(x.data_ptr(), _W8A8_KIND[x.dtype], x.stride(0), rows, k, panels.data_ptr(),
                          bias128.data_ptr(), w_scale.data_ptr(), 2 * gate_size, out.data_ptr(), gate_size,
                          _W8A8_KIND[x.dtype]):
        raise MemoryError("w8a8_silu_gate: the kernel refused the shapes or had no memory for its scratch")
    return out
