"""Native CPU kernels: C sources beside this file, compiled once per machine and loaded with ctypes.

The worker's CPU decode attention reads the paged cache directly (cpu_decode_attention.c)
instead of gathering each request's blocks into a padded copy for SDPA: 2-4x faster for 32-64
decodes and ~9x for a few (bench/log/2026-11-25.md); rotary embedding (cpu_rotary.c) is one pass
instead of six torch ops, with the same roundings; a prompt chunk's causal attention
(cpu_prefill_attention.c) tiles queries and keys in registers where SDPA's per-block overhead
dominates at small head dims. Each has bfloat16 and float16 forms (cpu_*_half.c, cpu_half.h):
values widened to float32 in registers, float32 arithmetic, with the instructions this CPU has
(kernel_variant() names them; the worker logs it). No pagedserve
install step compiles anything, and a machine without a C compiler still serves through the
torch path (worker_proc/decode_attention.py); so the library is built on first use with the
compiler the machine has (``$CC``, else ``cc``), for this CPU (``-march=native``), and cached.

The cache is a private directory (0700, owned by this user; ``$PAGEDSERVE_KERNEL_CACHE`` or
``~/.cache/pagedserve/kernels``): a library is code this process runs, so one that anybody
else could have written there is never loaded. A file's name hashes the source, the flags,
the compiler's version and the CPU's flags, so a change of any of them builds anew.
``PAGEDSERVE_CPU_KERNELS=torch`` turns native kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("pagedserve.kernels")

CPU_KERNELS_ENV = "PAGEDSERVE_CPU_KERNELS"
CACHE_ENV = "PAGEDSERVE_KERNEL_CACHE"
# Each source with its own flags: rotary must not fuse a multiply and an add (bit for bit
# torch's rounding), while attention's sums gain 7-10% from the fusion.
SOURCES = {Path(__file__).with_name("cpu_decode_attention.c"): (),
           Path(__file__).with_name("cpu_decode_attention_half.c"): (),
           Path(__file__).with_name("cpu_linear.c"): (),
           Path(__file__).with_name("cpu_gemv.c"): (),
           Path(__file__).with_name("cpu_gemv_int8.c"): (),
           Path(__file__).with_name("cpu_gemv_int4.c"): (),
           Path(__file__).with_name("cpu_gemm_w8a8.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_lora.c"): (),
           Path(__file__).with_name("cpu_moe.c"): (),
           Path(__file__).with_name("cpu_rms_norm_half.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_silu_mul_half.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_fp8_round.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_rotary.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_dequantize.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_gemm_q8_0.c"): ("-ffp-contract=off",),
           Path(__file__).with_name("cpu_rotary_half.c"): ("-ffp-contract=off",),
           # its loops over keys (softmax) take 512-bit vectors where the CPU has them
           Path(__file__).with_name("cpu_prefill_attention.c"): ("-mprefer-vector-width=512",)}
HEADERS = (Path(__file__).with_name("cpu_softmax_exp.h"), Path(__file__).with_name("cpu_half.h"),
           Path(__file__).with_name("cpu_gemv_rows.h"), Path(__file__).with_name("cpu_q8_0_panels.h"))  # hashed too
# OpenMP runs the loops on torch's own threads: the library links libgomp.so.1, which the
# loader resolves to the copy torch already loaded. Without -fopenmp it runs on one thread.
_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_DECODE_ARGS = [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P]
_ROTARY_ARGS = [_P, _I, _P, _P, _P, _P, _I, _I, _I]
_SIGNATURES = {
    **{f"paged_decode_attention_{suffix}": _DECODE_ARGS for suffix in ("f32", "bf16", "f16")},
    **{f"rotary_{suffix}": _ROTARY_ARGS for suffix in ("f32", "bf16", "f16")},
    **{f"rotary_write_kv_{suffix}": [*_ROTARY_ARGS, _P, _I, _I, _P, _P, _P, _I] for suffix in ("bf16", "f16")},
    "prefill_attention_f32": [_P, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, ctypes.c_float,
                              _P],
    "cpu_kernel_variant": [],
    **{f"{name}_{suffix}": [_P, _I, _I, _I, _P, _I, _P, _P, _I]
       for name in ("linear", "silu_gate") for suffix in ("f32", "bf16", "f16")},
    "linear_f32_available": [],
    **{f"gemv_{suffix}": [_P, _I, _I, _I, _P, _I, _I, _P, ctypes.c_int, _P, _I, ctypes.c_int]
       for suffix in ("f32", "bf16", "f16")},
    "gemv_panels_bf16": [_P, _I, _I, _I, _P, _I, _P, _P, _I, ctypes.c_int],
    **{name: [_P, _I, _I, _I, _P, _P, _I, _I, _P, _I, ctypes.c_int] for name in ("gemv_int8_blocks", "gemv_fp8_blocks")},
    "q8_0_variant": [],
    **{name: [_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _I, ctypes.c_int] for name in ("gemm_q8_0_panels", "gemm_q5_0_panels")},
    "dequantize_weight": [ctypes.c_int, _P, _P, ctypes.c_int, _P, _P, _I, _I, _I, _P, ctypes.c_int],
    "gemv_int4_blocks": [_P, ctypes.c_int, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, ctypes.c_int],
    "gemv_int4_variant": [],
    "w8a8_linear": [_P, ctypes.c_int, _I, _I, _I, _P, _P, _P, _I, _P, _I, ctypes.c_int, _P, _P],
    "w8a8_silu_gate": [_P, ctypes.c_int, _I, _I, _I, _P, _P, _P, _I, _P, _I, ctypes.c_int],
    "w8a8_variant": [],
    **{f"rms_norm_{suffix}": [_P, _P, _P, _P, _I, _I, ctypes.c_float, _I] for suffix in ("bf16", "f16")},
    **{f"silu_mul_{suffix}": [_P, _P, _I, _I] for suffix in ("bf16", "f16")},
    "fp8_round_rows": [_P, ctypes.c_int, _I, _I, _I, _P, ctypes.c_float, _P],
    "moe_experts_bf16": [_P, _I, _I, _I, _P, _P, _I, _I, _I, _P, _P, _P, _P, ctypes.c_int, ctypes.c_float,
                         ctypes.c_float, _P, _I],
    "lora_shrink_expand": [_P, ctypes.c_int, _I, _I, _P, ctypes.c_int, _I, _I, _P, _P, _P, _P, _I, _P, _I, ctypes.c_int,
                           _P, _P, _P, _P],
}
_RESTYPES = {"prefill_attention_f32": ctypes.c_int,
             **{f"rotary_write_kv_{s}": ctypes.c_int for s in ("bf16", "f16")}, "cpu_kernel_variant": ctypes.c_char_p,
             "linear_f32_available": ctypes.c_int,
             **{f"gemv_{s}": ctypes.c_int for s in ("f32", "bf16", "f16")}, "gemv_panels_bf16": ctypes.c_int,
             "gemv_int8_blocks": ctypes.c_int, "gemv_fp8_blocks": ctypes.c_int, "gemv_int4_blocks": ctypes.c_int,
             **dict.fromkeys(("gemm_q8_0_panels", "gemm_q5_0_panels"), ctypes.c_int),
             "q8_0_variant": ctypes.c_char_p, "dequantize_weight": ctypes.c_int, "gemv_int4_variant": ctypes.c_char_p,
             "w8a8_linear": ctypes.c_int, "w8a8_silu_gate": ctypes.c_int, "w8a8_variant": ctypes.c_char_p,
             **{f"silu_gate_{s}": ctypes.c_int for s in ("f32", "bf16", "f16")}, "lora_shrink_expand": ctypes.c_int,
             "moe_experts_bf16": ctypes.c_int, "fp8_round_rows": ctypes.c_int}
# The kernels' name for each dtype they take (their symbols end in it).
DTYPE_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
PREFILL_HEAD_DIMS = range(32, 257, 32)  # cpu_prefill_attention.c: multiples of DB up to MAX_D
LINEAR_PANEL = 16  # cpu_linear.c's NR: a packed weight's columns per panel
GEMV_MAX_ROWS = 8  # cpu_gemv.c's: products of 1..8 rows
# gemv()'s out_kind by the result's dtype
GEMV_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HALF_DTYPES = (torch.bfloat16, torch.float16)

_library: Optional[ctypes.CDLL] = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _private_dir(path: Path) -> bool:
    """Create path (0700) if missing; True only if it is ours and nobody else may write it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cache_dir() -> Optional[Path]:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve", "kernels")
    path = Path(base)
    return path if _private_dir(path) else None


def _run(cmd: list[str]) -> Optional[str]:
    """None when the command succeeded, else what it said."""
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if result.returncode == 0 else (result.stderr.strip()[-500:] or f"exit {result.returncode}")


def _compile(compiler: str, out_dir: Path, name: str, march: str) -> Optional[Path]:
    target = out_dir / name
    if target.exists():
        return target
    for openmp in (("-fopenmp",), ()):
        with tempfile.TemporaryDirectory(dir=out_dir) as work:
            objects = [str(Path(work) / f"{src.stem}.o") for src in SOURCES]
            commands = [[compiler, f"-march={march}", *_FLAGS, *extra, *openmp, "-c", str(src), "-o", obj]
                        for (src, extra), obj in zip(SOURCES.items(), objects)]
            commands.append([compiler, "-shared", *openmp, *objects, "-o", str(Path(work) / name)])
            error = next((e for e in map(_run, commands) if e is not None), None)
            if error is None:
                os.replace(Path(work) / name, target)  # atomic: a concurrent worker sees all or none
                return target
        log.info("building the native CPU kernels%s failed: %s", " with OpenMP" if openmp else "", error)
    log.warning("native CPU kernels did not compile; using the torch path")
    return None


def _build(march: str = "native") -> Optional[ctypes.CDLL]:
    """The library for this CPU; another ``march`` (an x86-64 level, say) builds the variant that a
    CPU of that level would get, which tests run where this CPU can."""
    if os.environ.get(CPU_KERNELS_ENV, "").strip().lower() == "torch":
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s) found; the CPU kernels use the torch path", compiler)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts = [f"{src.name}:{' '.join(extra)}:{src.read_text()}" for src, extra in SOURCES.items()]
    parts += [f"{header.name}:{header.read_text()}" for header in HEADERS]
    key = hashlib.sha256("\0".join([*parts, march, " ".join(_FLAGS), version, _cpu_flags()]).encode())
    name = f"cpu_kernels-{key.hexdigest()[:24]}.so"
    cache = _cache_dir()
    if cache is not None:
        return _load(_compile(compiler, cache, name, march))
    with tempfile.TemporaryDirectory(prefix="pagedserve-kernels-") as tmp:  # private, this run only
        return _load(_compile(compiler, Path(tmp), name, march))  # the mapping outlives the file


def _load(path: Optional[Path]) -> Optional[ctypes.CDLL]:
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        for symbol, argtypes in _SIGNATURES.items():
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = argtypes, _RESTYPES.get(symbol)
        return lib
    except (OSError, AttributeError) as exc:  # an unreadable or foreign file: never worth a crash
        log.warning("native CPU kernels at %s did not load (%s); using the torch path", path, exc)
        return None


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, built on the first call; None where they cannot be (torch path)."""
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _build()
    return _library


def kernel_variant() -> Optional[str]:
    """Which instructions the half precision kernels use on this CPU ("avx512bf16", "avx512",
    "avx2" or "scalar"); None where the library is not built."""
    lib = library()
    return None if lib is None else lib.cpu_kernel_variant().decode()


def _native_dtype(*tensors: torch.Tensor) -> bool:
    """All on CPU in one dtype the kernels take, and the library built."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_SUFFIXES:
        return False
    for t in tensors:  # a loop, not all() over a generator: ~100 small native calls a decode step ask this
        if t.dtype != dtype or not t.is_cpu:
            return False
    return library() is not None


def supports_decode(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention serves these tensors: query and cache of one dtype
    (float32, bfloat16 or float16) on CPU, library built."""
    return _native_dtype(query, k_cache)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                           scale: float, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query [B, q_heads, dim], one token per request at position last[b], seeing keys
    first[b]..last[b] of its blocks; k/v_cache [N, block_size, kv_heads, dim] (one layer).
    Returns [B, q_heads, dim] in the query's dtype, float32 arithmetic (supports_decode).
    ``sinks`` [q_heads]: a logit per head in every softmax that weighs no value (gpt-oss)."""
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_q_heads % num_kv_heads or block_tables.dtype != torch.int32:
        raise ValueError("paged_decode_attention: mismatched shapes or block table dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode_attention: the cache must be contiguous")
    query, block_tables = query.contiguous(), block_tables.contiguous()
    if first.dtype != torch.int64 or last.dtype != torch.int64:  # a decode context's are already
        first, last = first.to(torch.int64), last.to(torch.int64)
    first, last = first.contiguous(), last.contiguous()
    sinks = _sink_logits(sinks, num_q_heads)
    out = torch.empty_like(query)
    _decode_kernels(library())[query.dtype](
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        first.data_ptr(), last.data_ptr(), out.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim,
        block_size, scale, None if sinks is None else sinks.data_ptr())
    return out


def _sink_logits(sinks: Optional[torch.Tensor], num_q_heads: int) -> Optional[torch.Tensor]:
    """The attention kernels' sinks: float32 [q_heads], contiguous (the kernel reads one per head)."""
    if sinks is None:
        return None
    if sinks.shape != (num_q_heads,):
        raise ValueError(f"attention sinks: one per query head ({num_q_heads}), got {tuple(sinks.shape)}")
    return sinks.to(device="cpu", dtype=torch.float32).contiguous()


def supports_rotary(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether rotary serves these tensors: x and table of one dtype the kernels take, on CPU,
    heads and dims contiguous."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and _native_dtype(x, table)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] (rows may be strided, as a view of qkv), cos/sin [P, dim/2] contiguous,
    positions [T] int64 < P (the caller's table covers them). Returns a new [T, heads, dim]."""
    tokens, heads, dim = x.shape
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    kernel = getattr(library(), f"rotary_{DTYPE_SUFFIXES[x.dtype]}")
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), out.data_ptr(), tokens,
           heads, dim)
    return out


def supports_rotary_write_kv(x: torch.Tensor, table: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor) -> bool:
    """Whether rotary_write_kv serves these tensors: bfloat16 or float16 throughout (the cache in x's dtype), x as
    supports_rotary takes it, value's heads and dims contiguous, each cache contiguous."""
    dtype = x.dtype  # checked attribute by attribute: this runs once a layer, every decode step
    return (dtype in _HALF_DTYPES and table.dtype == dtype and value.dtype == dtype and k_cache.dtype == dtype
            and v_cache.dtype == dtype and x.is_cpu and table.is_cpu and value.is_cpu and k_cache.is_cpu
            and v_cache.is_cpu and x.dim() == 3
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and value.dim() == 3 and value.stride(2) == 1
            and value.stride(1) == value.shape[2] and k_cache.is_contiguous() and v_cache.is_contiguous()
            and library() is not None)


def rotary_write_kv(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """rotary(x, cos, sin, positions) in one call with the KV write (kernels/cpu_rotary_half.c): x [T, heads,
    dim] holds each token's query heads and then its key heads, as many as value [T, kv_heads, dim] has; the
    rotated keys and the values go to flat slot ``slot_mapping[t]`` of k_cache / v_cache [blocks, block_size,
    kv_heads, dim] (reference.write_kv's contract: -1 skipped). Returns the rotated x, a new [T, heads, dim]."""
    tokens, heads, dim = x.shape
    kv_heads = value.shape[1]
    if (value.shape != (tokens, kv_heads, dim) or kv_heads > heads or k_cache.shape != v_cache.shape
            or k_cache.shape[2:] != (kv_heads, dim) or slot_mapping.shape != (tokens,)):
        raise ValueError("rotary_write_kv: x, the value, the caches and the slots do not match")
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    if _half_kernels(library(), "rotary_write_kv")[x.dtype](x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                 out.data_ptr(), tokens, heads, dim, value.data_ptr(), value.stride(0), kv_heads,
                                 slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                 k_cache.shape[0] * k_cache.shape[1]):
        raise IndexError("rotary_write_kv: a slot outside the cache")
    return out


def supports_prefill(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether prefill_attention serves these tensors: one dtype the kernels take, on CPU, a
    head_dim the kernel tiles."""
    return query.shape[2] in PREFILL_HEAD_DIMS and _native_dtype(query, key)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] with heads and dims contiguous in a row (rows may be strided)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                      first: torch.Tensor, length: torch.Tensor, scale: float,
                      key_first: Optional[torch.Tensor] = None, context: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None) -> None:
    """Causal attention of prompt chunks: chunk c is rows first[c]..+length[c] of query
    [T, q_heads, dim]; its keys are rows key_first[c]..+context[c]+length[c] of key/value
    [S, kv_heads, dim] (context[c] cached tokens, then its own), and its query i sees keys up to
    context[c]+i. Without key_first and context, every chunk attends to its own rows of key and
    value. Writes those rows of out [T, q_heads, dim] (contiguous), in its dtype (supports_prefill).

    bfloat16 and float16 run the float32 kernel on widened copies: widening is linear in the rows
    where the attention is rows x keys, and the float32 tiles already run near the FMA peak.
    ``sinks`` [q_heads]: paged_decode_attention's."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key.shape[1]
    if (num_q_heads % num_kv_heads or value.shape != key.shape or out.shape != query.shape
            or not out.is_contiguous()):
        raise ValueError("prefill_attention: mismatched shapes or a strided output")
    target = out
    if out.dtype != torch.float32:  # the rows no chunk writes go back as they came (exactly)
        query, key, value, out = query.float(), key.float(), value.float(), out.float()
    query, key, value = _rows(query), _rows(key), _rows(value)
    first, length = first.to(torch.int64).contiguous(), length.to(torch.int64).contiguous()
    key_first = first if key_first is None else key_first.to(torch.int64).contiguous()
    context = torch.zeros_like(first) if context is None else context.to(torch.int64).contiguous()
    sinks = _sink_logits(sinks, num_q_heads)
    rc = library().prefill_attention_f32(
        query.data_ptr(), query.stride(0), query.shape[0], key.data_ptr(), key.stride(0), value.data_ptr(),
        value.stride(0), key.shape[0], first.data_ptr(), key_first.data_ptr(), context.data_ptr(),
        length.data_ptr(), len(first), out.data_ptr(), out.stride(0), num_q_heads, num_kv_heads, head_dim, scale,
        None if sinks is None else sinks.data_ptr())
    if rc == -2:  # what torch's indexing would raise, instead of a read out of bounds
        raise IndexError("prefill_attention: a chunk's rows lie outside the query or key tensors")
    if rc != 0:
        raise MemoryError("prefill_attention: no memory for its scratch buffers")
    if target is not out:
        target.copy_(out)


def supports_linear() -> bool:
    """Whether linear() runs here: the library built with AVX2 and FMA (cpu_linear.c)."""
    lib = library()
    return lib is not None and bool(lib.linear_f32_available())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> linear()'s panels [ceil(N / 16), K, 16] in the weight's dtype (float32,
    bfloat16 or float16; others become float32), zero past N: a panel's 16 columns of one k are
    one contiguous read."""
    n, k = weight.shape
    dtype = weight.dtype if weight.dtype in DTYPE_SUFFIXES else torch.float32
    panels = -(-n // LINEAR_PANEL)
    padded = torch.zeros(panels * LINEAR_PANEL, k, dtype=dtype)
    padded[:n] = weight
    return padded.view(panels, LINEAR_PANEL, k).transpose(1, 2).contiguous()


def pack_silu_gate_weight(weight: torch.Tensor, size: int) -> torch.Tensor:
    """A gate_up weight [2 * size, K] (gate rows first) -> silu_gate()'s panels: gate's and up's
    panels (pack_linear_weight's) alternating, [2 * ceil(size / 16), K, 16]."""
    gate, up = pack_linear_weight(weight[:size]), pack_linear_weight(weight[size:])
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def silu_gate(x: torch.Tensor, panels: torch.Tensor, size: int, bias: Optional[torch.Tensor] = None,
              lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) (+ their biases, bias [2 * size]) from pack_silu_gate_weight's
    panels: [M, size] float32, the gate and up products linear()'s bit for bit."""
    out, failed = _panel_product("silu_gate", x, panels, 2 * size, size, bias, lib)
    if failed:
        raise MemoryError("silu_gate: no memory for a thread's scratch")
    return out


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: Optional[torch.Tensor] = None,
           lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided) @ the weight packed into ``panels`` by
    pack_linear_weight (+ bias [N]): [M, N] contiguous float32, float32 arithmetic whatever the
    panels' dtype. ``lib``: a variant's library (tests), else this CPU's. A decode step makes a
    hundred of these calls, so the checks are the few that keep the kernel's reads in bounds."""
    return _panel_product("linear", x, panels, out_features, out_features, bias, lib)[0]


def _panel_product(kind: str, x: torch.Tensor, panels: torch.Tensor, columns: int, out_columns: int,
                   bias: Optional[torch.Tensor], lib: Optional[ctypes.CDLL]) -> tuple[torch.Tensor, Optional[int]]:
    """One call of a panel kernel (``kind``): the panels must hold ``columns``, the result has
    ``out_columns``; (the result, what the kernel returned)."""
    rows, k = x.shape
    if x.dtype != torch.float32 or panels.shape[1] != k or panels.shape[0] * LINEAR_PANEL < columns:
        raise ValueError(f"{kind}: x does not match the packed weight")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    out = torch.empty(rows, out_columns, dtype=torch.float32)
    kernel = _linear_kernels(lib or library())[kind, panels.dtype]
    returned = kernel(x.data_ptr(), x.stride(0), rows, k, panels.data_ptr(), out_columns,
                      None if bias is None else bias.data_ptr(), out.data_ptr(), out_columns)
    return out, returned


@functools.cache
def _linear_kernels(lib: ctypes.CDLL) -> dict:
    """The library's panel kernels by (kind, panel dtype), looked up once."""
    return {(kind, dtype): getattr(lib, f"{kind}_{suffix}")
            for kind in ("linear", "silu_gate") for dtype, suffix in DTYPE_SUFFIXES.items()}


def gemv_variant(lib: Optional[ctypes.CDLL] = None) -> Optional[str]:
    """Which instructions gemv() uses here ("avx512bf16": bfloat16 by vdpbf16ps, float32 and float16
    widened on AVX-512; "avx512", "avx2", "scalar": all widened to float32); None without the library."""
    lib = lib or library()
    # one ladder for the library (cpu_half.h): vdpbf16ps here exactly where the decode attention has it
    return None if lib is None else lib.cpu_kernel_variant().decode()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= GEMV_MAX_ROWS; rows may be strided) @ weight[N, K].T (+ bias [N]), x,
    weight and bias of one dtype (float32, bfloat16 or float16), the weight as loaded (rows
    contiguous in K, rows may be strided): [M, N] contiguous in ``out_dtype`` (default x's; float32
    keeps the sums unrounded), float32 sums (kernels/cpu_gemv.c). A decode step makes a hundred of
    these calls, so the checks are the few that keep the kernel's reads in bounds."""
    rows, k = x.shape
    dtype = x.dtype
    if (weight.dtype != dtype or dtype not in DTYPE_SUFFIXES or weight.dim() != 2 or weight.shape[1] != k
            or not 1 <= rows <= GEMV_MAX_ROWS or (bias is not None and bias.shape != (weight.shape[0],))):
        raise ValueError("gemv: x, weight and bias do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    bias_f32 = 0
    if bias is not None and bias.dtype != dtype:
        bias, bias_f32 = bias.float().contiguous(), 1
    elif bias is not None:
        bias = bias.contiguous()
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype or dtype)
    _gemv_kernels(lib or library())[dtype](
        x.data_ptr(), x.stride(0), rows, k, weight.data_ptr(), weight.stride(0), n,
        None if bias is None else bias.data_ptr(), bias_f32, out.data_ptr(), n, GEMV_OUT_KIND[out.dtype])
    return out


def supports_gemv_panels() -> bool:
    """Whether gemv_panels() runs here: bfloat16 by vdpbf16ps (AVX512-BF16)."""
    return gemv_variant() == "avx512bf16"


def pack_gemv_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] -> gemv_panels()'s layout [ceil(N/16), ceil(K/2), 16, 2], zero past N and K:
    a panel's 16 rows with each row's k pair adjacent, one 64-byte line per k pair."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, -(-k // 2) * 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(-1, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemv_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: Optional[torch.Tensor] = None,
                out_dtype: torch.dtype = torch.bfloat16, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """x [M, K] bfloat16 (1 <= M <= GEMV_MAX_ROWS) @ the weight packed by pack_gemv_panels (+ bias [N]
    bfloat16): [M, N] in ``out_dtype`` (bfloat16 or float32), float32 sums by vdpbf16ps (supports_gemv_panels)."""
    rows, k = x.shape
    if (x.dtype != torch.bfloat16 or panels.dtype != torch.bfloat16 or panels.shape[1] != -(-k // 2)
            or panels.shape[0] * 16 < out_features or not 1 <= rows <= GEMV_MAX_ROWS
            or (bias is not None and bias.shape != (out_features,))):
        raise ValueError("gemv_panels: x, the panels and bias do not match")
    if k % 2:  # the kernel reads x in pairs: the pad's products are 0 * 0
        x = torch.cat([x, x.new_zeros(rows, 1)], dim=1)
    elif x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    out = torch.empty(rows, out_features, dtype=out_dtype)
    (lib or library()).gemv_panels_bf16(x.data_ptr(), x.stride(0), rows, k, panels.data_ptr(), out_features,
                                        None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                        GEMV_OUT_KIND[out_dtype])
    return out


@functools.cache
def _decode_kernels(lib: ctypes.CDLL) -> dict:
    return {dtype: getattr(lib, f"paged_decode_attention_{suffix}") for dtype, suffix in DTYPE_SUFFIXES.items()}


@functools.cache
def _half_kernels(lib: ctypes.CDLL, name: str) -> dict:
    """A half-precision kernel's symbol by dtype, looked up once: a decode step makes ~100 small calls."""
    return {dtype: getattr(lib, f"{name}_{DTYPE_SUFFIXES[dtype]}") for dtype in _HALF_DTYPES}


@functools.cache
def _gemv_kernels(lib: ctypes.CDLL) -> dict:
    return {dtype: getattr(lib, f"gemv_{suffix}") for dtype, suffix in DTYPE_SUFFIXES.items()}


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm serves these tensors: bfloat16 or float16 on CPU, x contiguous, weight [x's last dim]
    or one per head, [heads, d] for x [..., heads, d] (the per-head weights of a fused q and k)."""
    return (x.dtype in _HALF_DTYPES and weight.dtype == x.dtype and x.is_cpu and weight.is_cpu and x.is_contiguous()
            and (weight.shape == x.shape[-1:] or (weight.dim() == 2 and x.dim() >= 3 and weight.shape == x.shape[-2:]))
            and weight.is_contiguous() and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm over x's last dim (kernels/cpu_rms_norm_half.c, supports_rms_norm), a new tensor; with
    ``residual`` (x's shape and dtype), x += residual first, rounded as torch's add_ rounds, in place.
    ``weight`` [d], or [heads, d] for x [..., heads, d]: each head by its own row."""
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("rms_norm: the residual does not match x")
        residual = residual.contiguous()
    d = x.shape[-1]
    out = torch.empty_like(x)
    _half_kernels(library(), "rms_norm")[x.dtype](
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // d if d else 0, d, eps, weight.shape[0] if weight.dim() == 2 else 1)
    return out


# silu_mul's rows at most: one stream's 1 row 8.1 us against torch's three ops' 10.1, 8 rows 23.1 against 23.4, but
# 64 rows 162 against 127 (a 0.5B's 4864-wide gate, 2 threads, Zen 4): torch's vectorized exp is the faster there.
SILU_MUL_MAX_ROWS = 8


def supports_silu_mul(gate_up: torch.Tensor) -> bool:
    """Whether silu_mul serves this tensor: bfloat16 or float16 on CPU, [rows, 2 * size] contiguous, rows at most
    SILU_MUL_MAX_ROWS."""
    return (gate_up.dtype in _HALF_DTYPES and gate_up.is_cpu and gate_up.dim() == 2
            and gate_up.shape[0] <= SILU_MUL_MAX_ROWS and gate_up.is_contiguous() and library() is not None)


def silu_mul(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    """silu(gate) * up of each row of gate_up [rows, 2 * size] (its gate, then its up; supports_silu_mul), a new
    [rows, size] with torch's two roundings (kernels/cpu_silu_mul_half.c)."""
    rows = gate_up.shape[0]
    if gate_up.shape[1] != 2 * size:
        raise ValueError(f"silu_mul: {gate_up.shape[1]} columns are not a gate and an up of {size}")
    out = torch.empty((rows, size), dtype=gate_up.dtype)
    _half_kernels(library(), "silu_mul")[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, size)
    return out


def fp8_round_rows(x: torch.Tensor, row_max: Optional[torch.Tensor] = None,
                   static_scale: Optional[float] = None) -> torch.Tensor:
    """Each row of x [rows, cols] (float32, bfloat16 or float16, unit column stride) rounded through
    float8_e4m3fn and back, a new contiguous tensor: by max |row| / 448 (``row_max`` [rows, 1] in x's dtype
    where given), or by ``static_scale`` (kernels/cpu_fp8_round.c; models/fp8_linear.py's torch ops' bits)."""
    rows, cols = x.shape
    if x.dtype not in GEMV_OUT_KIND or x.stride(1) != 1 or (row_max is not None and (
            row_max.dtype != x.dtype or row_max.numel() != rows or not row_max.is_contiguous())):
        raise ValueError("fp8_round_rows: x must be [rows, cols] float32 / bfloat16 / float16 rows, row_max [rows]")
    out = torch.empty((rows, cols), dtype=x.dtype)
    if library().fp8_round_rows(x.data_ptr(), GEMV_OUT_KIND[x.dtype], rows, cols, x.stride(0),
                                None if row_max is None else row_max.data_ptr(), static_scale or 0.0,
                                out.data_ptr()):
        raise ValueError("fp8_round_rows: the kernel refused the shapes")
    return out


_LORA_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_lora.c's ``kind``


class LoRAGroupKernel:
    """LoRA's delta of a projection group for tokens grouped by slot (kernels/cpu_lora.c), its weights checked
    and turned into the call's arguments once: a decode step makes ~100 of these calls, and building and
    checking them each time cost as much as a small group's kernel.

    ``a`` [slots, modules * R, K] (every module's A of a slot stacked: one shrink for the group), ``bs[j]``
    [slots, R, out_j], module j's delta added to the output's columns ``columns[j]`` .. + out_j, the modules
    whose ``expand[j]`` is False skipped. All contiguous, of one dtype (float32, bfloat16 or float16)."""

    def __init__(self, a: torch.Tensor, bs: list[torch.Tensor], columns: list[int], expand: list[bool]):
        modules, r_max = len(bs), bs[0].shape[1]
        if (a.dtype not in _LORA_KIND or a.dim() != 3 or a.shape[1] != modules * r_max or not a.is_contiguous()
                or len(columns) != modules or len(expand) != modules
                or any(not b.is_contiguous() or b.dtype != a.dtype or b.shape[:2] != (a.shape[0], r_max) for b in bs)):
            raise ValueError("LoRAGroupKernel: a and bs do not match")
        self._weights = (a, bs)  # the pointers below stay valid while these live
        self.in_features, self.width = a.shape[2], max(c + b.shape[2] for c, b in zip(columns, bs))
        array = ctypes.c_int64 * modules
        self._args = (a.data_ptr(), _LORA_KIND[a.dtype], modules, r_max)
        self._modules = (array(*(b.data_ptr() for b in bs)), array(*(b.shape[2] for b in bs)), array(*columns),
                         array(*map(int, expand)))

    def __call__(self, x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor,
                 slots: torch.Tensor, ranks: torch.Tensor) -> None:
        """y[t] += each module's (x[t] @ A_j[slot].T) @ B_j[slot] in its columns, in place, rounded once to y's dtype;
        x [T, K] of any of the three dtypes (widened as read), rows strided. ``tokens``: the adapter tokens' rows
        in segment order, segment i ``tokens[starts[i]:starts[i + 1]]`` on slot ``slots[i]``; ``ranks`` [slots]
        each slot's adapter rank (rows past it are zeros, skipped). Index tensors int64, contiguous."""
        if (x.dtype not in _LORA_KIND or y.dtype not in _LORA_KIND or x.dim() != 2 or x.shape[1] != self.in_features
                or x.stride(1) != 1 or y.dim() != 2 or y.stride(1) != 1 or y.shape[0] != x.shape[0]
                or y.shape[1] < self.width):
            raise ValueError("LoRAGroupKernel: x and y do not match the group's weights")
        if library().lora_shrink_expand(
                x.data_ptr(), _LORA_KIND[x.dtype], x.stride(0), self.in_features, *self._args, tokens.data_ptr(),
                starts.data_ptr(), slots.data_ptr(), ranks.data_ptr(), slots.shape[0], y.data_ptr(), y.stride(0),
                _LORA_KIND[y.dtype], *self._modules):
            raise MemoryError("lora_shrink_expand: no memory for its scratch")


def supports_lora() -> bool:
    return library() is not None
