"""Native CPU kernels: C sources beside this file, compiled once per machine and loaded with ctypes.

The worker's CPU decode attention reads the paged cache directly (cpu_decode_attention.c)
instead of gathering each request's blocks into a padded copy for SDPA: 2-4x faster for 32-64
decodes and ~9x for a few (bench/RESULTS.md); rotary embedding (cpu_rotary.c) is one pass
instead of six torch ops, with the same roundings. No pagedserve
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
           Path(__file__).with_name("cpu_rotary.c"): ("-ffp-contract=off",)}
# OpenMP runs the loops on torch's own threads: the library links libgomp.so.1, which the
# loader resolves to the copy torch already loaded. Without -fopenmp it runs on one thread.
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "paged_decode_attention_f32": [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float],
    "rotary_f32": [_P, _I, _P, _P, _P, _P, _I, _I, _I],
}

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


def _compile(compiler: str, out_dir: Path, name: str) -> Optional[Path]:
    target = out_dir / name
    if target.exists():
        return target
    for openmp in (("-fopenmp",), ()):
        with tempfile.TemporaryDirectory(dir=out_dir) as work:
            objects = [str(Path(work) / f"{src.stem}.o") for src in SOURCES]
            commands = [[compiler, *_FLAGS, *extra, *openmp, "-c", str(src), "-o", obj]
                        for (src, extra), obj in zip(SOURCES.items(), objects)]
            commands.append([compiler, "-shared", *openmp, *objects, "-o", str(Path(work) / name)])
            error = next((e for e in map(_run, commands) if e is not None), None)
            if error is None:
                os.replace(Path(work) / name, target)  # atomic: a concurrent worker sees all or none
                return target
        log.info("building the native CPU kernels%s failed: %s", " with OpenMP" if openmp else "", error)
    log.warning("native CPU kernels did not compile; using the torch path")
    return None


def _build() -> Optional[ctypes.CDLL]:
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
    key = hashlib.sha256("\0".join([*parts, " ".join(_FLAGS), version, _cpu_flags()]).encode())
    name = f"cpu_kernels-{key.hexdigest()[:24]}.so"
    cache = _cache_dir()
    if cache is not None:
        return _load(_compile(compiler, cache, name))
    with tempfile.TemporaryDirectory(prefix="pagedserve-kernels-") as tmp:  # private, this run only
        return _load(_compile(compiler, Path(tmp), name))  # the mapping outlives the file


def _load(path: Optional[Path]) -> Optional[ctypes.CDLL]:
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        for symbol, argtypes in _SIGNATURES.items():
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = argtypes, None
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


def supports_decode(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention serves these tensors (float32 on CPU, library built)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and k_cache.dtype == torch.float32
            and library() is not None)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """query [B, q_heads, dim], one token per request at position last[b], seeing keys
    first[b]..last[b] of its blocks; k/v_cache [N, block_size, kv_heads, dim] (one layer).
    Returns [B, q_heads, dim]. float32 only (supports_decode)."""
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_q_heads % num_kv_heads or block_tables.dtype != torch.int32:
        raise ValueError("paged_decode_attention: mismatched shapes or block table dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode_attention: the cache must be contiguous")
    query, block_tables = query.contiguous(), block_tables.contiguous()
    first, last = first.to(torch.int64).contiguous(), last.to(torch.int64).contiguous()
    out = torch.empty_like(query)
    library().paged_decode_attention_f32(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        first.data_ptr(), last.data_ptr(), out.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim,
        block_size, scale)
    return out


def supports_rotary(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether rotary serves these tensors: float32 on CPU, heads and dims contiguous."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and table.dtype == torch.float32
            and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and library() is not None)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] (rows may be strided, as a view of qkv), cos/sin [P, dim/2] contiguous,
    positions [T] int64 < P (the caller's table covers them). Returns a new [T, heads, dim]."""
    tokens, heads, dim = x.shape
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype)
    library().rotary_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                         out.data_ptr(), tokens, heads, dim)
    return out
