"""The integer weights' CPU kernels (cpu_gemv_int8.c, cpu_gemv_int4.c, cpu_gemm_w8a8.c): each weight layout
they read, its packing and unpacking, and the call.

A quantized checkpoint's matrices (worker_proc/models/quantized_linear.py) are kept in these layouts: int8 with
a scale per block of inputs (W8A16, GGUF Q8_0 and Q6_K), Q8_0 and Q5_0 in tiles of 8 rows (a decode step reads a
tile as one stream; Q5_0 at its file's 5 bits), int4 nibbles in runs of 32 (W4A16, GPTQ, AWQ, GGUF Q4_0/Q4_1/Q4_K),
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
    (kernels/cpu_gemv_int8.c). ``block`` a multiple of the vector width (16 suffices everywhere) dividing K."""
    rows, k = x.shape
    n = q.shape[0]
    if (q.dtype != torch.int8 or q.shape != (n, k) or scales.dtype != torch.float32 or block % 16
            or k % block or scales.shape != (n, k // block) or rows < 1):
        raise ValueError("gemv_int8_blocks: x, the weight and its scales do not match")
    xf = x.float().contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
    if (lib or cpu_native.library()).gemv_int8_blocks(xf.data_ptr(), k, rows, k, q.contiguous().data_ptr(),
                                           scales.contiguous().data_ptr(), block, n, out.data_ptr(), n,
                                           GEMV_OUT_KIND[out.dtype]):
        raise ValueError("gemv_int8_blocks: the kernel refused the shapes")
    return out


Q8_0_BLOCK = 32  # cpu_gemv_int8.c's gemv_q8_0: the inputs of a weight block and of an activation block


def q8_0_variant(lib: Optional[ctypes.CDLL] = None) -> Optional[str]:
    """Which instructions gemv_q8_0() multiplies with here ("avx512vnni", "portable"); None without the library."""
    lib = lib or cpu_native.library()
    return None if lib is None else lib.q8_0_variant().decode()


def gemv_q8_0(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
              lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """llama.cpp's Q8_0 x Q8_0: x [M, K] (M >= 1; float32, bfloat16 or float16; rows may be strided), each block
    of 32 inputs of a row quantized to int8 (d = max|x| / 127, round half to even of x / d), times (q [N, K] int8,
    scales [N, K / 32] float16, Q8_0's own).T, each block's int8 products summed exactly in int32 and scaled by both blocks'
    d in float32: [M, N] in ``out_dtype`` (default x's) (kernels/cpu_gemv_int8.c)."""
    rows, k = x.shape
    n = q.shape[0]
    if (x.dtype not in DTYPE_SUFFIXES or q.dtype != torch.int8 or q.shape != (n, k) or k % Q8_0_BLOCK
            or scales.dtype != torch.float16 or scales.shape != (n, k // Q8_0_BLOCK) or rows < 1):
        raise ValueError("gemv_q8_0: x, the weight and its scales do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
    lib = lib or cpu_native.library()
    if lib.gemv_q8_0(x.data_ptr(), _W8A8_KIND[x.dtype], x.stride(0), rows, k, q.contiguous().data_ptr(),
                     scales.contiguous().data_ptr(), n, out.data_ptr(), n, GEMV_OUT_KIND[out.dtype]):
        raise MemoryError("gemv_q8_0: the kernel refused the shapes or had no memory for its scratch")
    return out


Q5_0_CHUNK = 64  # cpu_gemv_int8.c's gemv_q5_0 and gemv_q8_0_tiles: a run of inputs (two blocks of 32)
_Q5_0_CHUNK_BYTES = 40  # 32 bytes of nibbles, then the 64 fifth bits
_TILE_ROWS = 8  # rows whose runs are stored side by side


def _to_tiles(runs: torch.Tensor, fill: int) -> torch.Tensor:
    """Rows of runs [N, K / 64, B] uint8 -> the kernels' tiles [ceil(N / 8) * 8, K / 64 * B]: per tile of 8 rows
    (``fill`` bytes past N), each run of the tile's rows side by side, so a decode step reads a tile as one stream."""
    n, chunks, size = runs.shape
    tiles = -(-n // _TILE_ROWS)
    out = torch.full((tiles * _TILE_ROWS, chunks, size), fill, dtype=torch.uint8)
    out[:n] = runs
    return out.view(tiles, _TILE_ROWS, chunks, size).transpose(1, 2).reshape(tiles * _TILE_ROWS, -1).contiguous()


def _from_tiles(tiled: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """_to_tiles' inverse: the first ``n`` rows' runs [n, K / 64, size]."""
    rows = tiled.shape[0]
    return tiled.view(rows // _TILE_ROWS, -1, _TILE_ROWS, size).transpose(1, 2).reshape(rows, -1, size)[:n]


def pack_q8_0_tiles(q: torch.Tensor) -> torch.Tensor:
    """Q8_0's values [N, K] int8 (K a multiple of 64) -> gemv_q8_0_tiles()'s layout [ceil(N / 8) * 8, K] int8:
    the rows in tiles of 8, a tile's runs of 64 inputs side by side."""
    n, k = q.shape
    if k % Q5_0_CHUNK or q.dtype != torch.int8:
        raise ValueError(f"pack_q8_0_tiles: {k} int8 inputs are not whole runs of {Q5_0_CHUNK}")
    return _to_tiles(q.view(torch.uint8).reshape(n, k // Q5_0_CHUNK, Q5_0_CHUNK), 0).view(torch.int8)


def unpack_q8_0_tiles(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """pack_q8_0_tiles' inverse: its first ``n`` rows, [n, K] int8."""
    return _from_tiles(tiled.view(torch.uint8), n, Q5_0_CHUNK).reshape(n, -1).view(torch.int8)


def pack_q5_0(q: torch.Tensor) -> torch.Tensor:
    """Signed 5-bit values [N, K] (int8 in [-16, 15], K a multiple of 64) -> gemv_q5_0()'s layout
    [ceil(N / 8) * 8, K / 64 * 40] uint8: per 64 inputs of a row, of u = q + 16, byte t holds u[t] & 15 in its low
    nibble and u[32 + t] & 15 in its high one (t < 32), then 8 bytes whose bit t (little-endian) is u[t]'s fifth
    bit; the rows in tiles of 8 (_to_tiles)."""
    n, k = q.shape
    if k % Q5_0_CHUNK or q.dtype != torch.int8:
        raise ValueError(f"pack_q5_0: {k} int8 inputs are not whole runs of {Q5_0_CHUNK}")
    u = (q.to(torch.int16) + 16).to(torch.uint8).view(n, k // Q5_0_CHUNK, 2, Q5_0_CHUNK // 2)
    nibbles = (u[..., 0, :] & 0xF) | ((u[..., 1, :] & 0xF) << 4)
    fifth = (u.reshape(n, k // Q5_0_CHUNK, 8, 8) >> 4) << torch.arange(8, dtype=torch.uint8)
    return _to_tiles(torch.cat([nibbles, fifth.sum(-1, dtype=torch.uint8)], dim=-1), 16)


def unpack_q5_0(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_q5_0's inverse: its first ``n`` rows, [n, K] int8 in [-16, 15] (the native loop where built)."""
    lib = cpu_native.library()
    if lib is not None:
        out = torch.empty(n, packed.shape[1] // _Q5_0_CHUNK_BYTES * Q5_0_CHUNK, dtype=torch.int8)
        lib.unpack_q5_0_tiles(packed.contiguous().data_ptr(), n, out.shape[1], out.data_ptr())
        return out
    runs = _from_tiles(packed, n, _Q5_0_CHUNK_BYTES)
    nib = runs[..., :32]
    low = torch.cat([nib & 0xF, nib >> 4], dim=-1)
    fifth = (runs[..., 32:].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return ((low | (fifth.reshape(low.shape) << 4)).to(torch.int8) - 16).reshape(n, -1)


def gemv_q8_0_tiles(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                    lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """gemv_q8_0 on the weight in tiles (pack_q8_0_tiles: [ceil(N / 8) * 8, K] int8, K a multiple of 64) with its
    float16 scales [N, K / 32]: the same outputs, bit for bit, read as one stream a tile."""
    return _q8_0_form("gemv_q8_0_tiles", x, tiled, torch.int8, Q5_0_CHUNK, scales, out_dtype, lib)


def _q8_0_form(name: str, x: torch.Tensor, w: torch.Tensor, w_dtype: torch.dtype, run_bytes: int,
               scales: torch.Tensor, out_dtype: Optional[torch.dtype], lib: Optional[ctypes.CDLL]) -> torch.Tensor:
    """The call of a tiled form of gemv_q8_0 (``name``), its shapes checked: w's runs of 64 inputs ``run_bytes``."""
    rows, k = x.shape
    n = scales.shape[0]
    if (x.dtype not in DTYPE_SUFFIXES or w.dtype != w_dtype or k % Q5_0_CHUNK
            or w.shape != (-(-n // _TILE_ROWS) * _TILE_ROWS, k // Q5_0_CHUNK * run_bytes) or scales.dtype != torch.float16
            or scales.shape != (n, k // Q8_0_BLOCK) or rows < 1):
        raise ValueError(f"{name}: x, the weight and its scales do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
    kernel = getattr(lib or cpu_native.library(), name)
    if kernel(x.data_ptr(), _W8A8_KIND[x.dtype], x.stride(0), rows, k, w.contiguous().data_ptr(),
              scales.contiguous().data_ptr(), n, out.data_ptr(), n, GEMV_OUT_KIND[out.dtype]):
        raise MemoryError(f"{name}: the kernel refused the shapes or had no memory for its scratch")
    return out


def gemv_q5_0(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
              lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """gemv_q8_0's product (x quantized per block of 32, each block's products summed exactly, scaled by both d)
    on a Q5_0 weight packed by pack_q5_0 ([ceil(N / 8) * 8, K / 64 * 40] uint8; K a multiple of 64) with its float16
    scales [N, K / 32]: the same outputs as gemv_q8_0 on unpack_q5_0(packed, N), in 35% fewer weight bytes."""
    return _q8_0_form("gemv_q5_0", x, packed, torch.uint8, _Q5_0_CHUNK_BYTES, scales, out_dtype, lib)


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
DEQUANTIZE_FORMATS = {"int8_blocks": 0, "q8_0": 1, "q5_0": 2, "int4_blocks": 3}


def _packed_shape(kind: str, n: int, k: int) -> tuple[int, int]:
    tiled = -(-n // _TILE_ROWS) * _TILE_ROWS
    return {"int8_blocks": (n, k), "q8_0": (tiled, k), "q5_0": (tiled, k // Q5_0_CHUNK * _Q5_0_CHUNK_BYTES),
            "int4_blocks": (n, k // 2)}[kind]


def dequantize(kind: str, weight: torch.Tensor, scales: torch.Tensor, n: int, k: int, group: int,
               dtype: torch.dtype, zeros: Optional[torch.Tensor] = None, mins: Optional[torch.Tensor] = None,
               lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """A packed weight of ``kind`` (DEQUANTIZE_FORMATS: the layouts above) as [n, k] ``dtype``, the values torch's
    ops make from its integers (q * scale, or (nibble - z) * scale, or nibble * scale - min, in float32, then one
    rounding), in one pass (kernels/cpu_dequantize.c). ``scales`` [n, k / group] float32 or float16 (Q8_0's, Q5_0's);
    ``zeros`` (8 + zero point) or ``mins`` [n, k / group] float32, int4_blocks only."""
    groups = (n, k // group) if group > 0 and k % group == 0 else None
    if (kind not in DEQUANTIZE_FORMATS or groups is None or tuple(weight.shape) != _packed_shape(kind, n, k)
            or scales.shape != groups or scales.dtype not in (torch.float32, torch.float16) or dtype not in GEMV_OUT_KIND
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


def pack_w8a8_weight(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight [N, K] -> (w8a8_linear()'s panels [ceil(N / 16), ceil(K / 4), 16, 4] int8, zero past N and
    K: a panel's 16 columns with 4 consecutive inputs each in one int32 lane; 128 * each padded column's sum
    [ceil(N / 16) * 16] int32, what the VNNI variant's unsigned activations (xq + 128) add)."""
    n, k = q.shape
    padded = torch.zeros(-(-n // W8A8_PANEL) * W8A8_PANEL, -(-k // 4) * 4, dtype=torch.int8)
    padded[:n, :k] = q
    panels = padded.view(-1, W8A8_PANEL, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return panels, (padded.sum(1, dtype=torch.int32) * 128).contiguous()


def w8a8_linear(x: torch.Tensor, panels: torch.Tensor, bias128: torch.Tensor, w_scale: torch.Tensor,
                out_features: int, out_dtype: Optional[torch.dtype] = None, x_scale_out: Optional[torch.Tensor] = None,
                lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16; rows may be strided), each row quantized to int8 per token
    (quantize_per_token's scale and rounding) @ the int8 weight packed by pack_w8a8_weight, the products summed
    exactly in int32, times both scales (``w_scale`` [N] float32): [M, N] in ``out_dtype`` (default x's; int32
    gives the sums themselves). ``x_scale_out`` [M] float32, where given, receives the rows' scales
    (kernels/cpu_gemm_w8a8.c)."""
    rows, k = x.shape
    if (x.dtype not in DTYPE_SUFFIXES or panels.dtype != torch.int8 or panels.shape[1:] != (-(-k // 4), W8A8_PANEL, 4)
            or panels.shape[0] * W8A8_PANEL < out_features or bias128.shape != (panels.shape[0] * W8A8_PANEL,)
            or w_scale.shape != (out_features,) or w_scale.dtype != torch.float32 or rows < 1):
        raise ValueError("w8a8_linear: x, the packed weight and its scales do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=out_dtype or x.dtype)
    if x_scale_out is not None and (x_scale_out.shape != (rows,) or x_scale_out.dtype != torch.float32):
        raise ValueError("w8a8_linear: x_scale_out must be [M] float32")
    lib = lib or cpu_native.library()
    if lib.w8a8_linear(x.data_ptr(), _W8A8_KIND[x.dtype], x.stride(0), rows, k, panels.data_ptr(),
                       bias128.data_ptr(), w_scale.data_ptr(), out_features, out.data_ptr(),
                       out_features, _W8A8_KIND[out.dtype], None if x_scale_out is None else x_scale_out.data_ptr()):
        raise MemoryError("w8a8_linear: the kernel refused the shapes or had no memory for its scratch")
    return out
