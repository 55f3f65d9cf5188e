"""What ``--dtype auto`` computes a half-precision checkpoint in on a CPU.

The rule is by ISA (/proc/cpuinfo's flags), as measured: bfloat16 where the CPU multiplies it
in hardware (AMX-BF16 tiles or AVX512-BF16 dot products, through oneDNN), float32 elsewhere.
With AVX512-BF16 (Zen 5) bfloat16 served the 0.5B shape 1.8x as fast as float32 offline, both
prefill- and decode-heavy (bench/log/2026-11-26.md, "CPU: bf16 on AVX512-BF16"); AMX multiplies
bfloat16 faster still and is taken unmeasured. On AVX2 (every AMD CPU before Zen 4, most Intel
laptops) torch's fallback ran the steps 2.4-6.5x slower than float32, and with the worker's native
linear kernel float32 arithmetic still beats bfloat16's (it keeps the checkpoint's half-precision
weights and widens them exactly: bench/log/2026-11-28.md "CPU: a native linear layer on AVX2"); AVX-512 without BF16
(Skylake-SP to Ice Lake) gets oneDNN's emulation, which widens to float32 and multiplies at
float32's rate, so it keeps float32 too (unmeasured). Where float32 is chosen it must fit half
the memory available: a model too large for that keeps bfloat16 (slow, but it fits), and the
log says so. A float32 checkpoint stays float32 everywhere, as in vLLM. ``--dtype`` overrides
any choice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger("pagedserve.dtype")

FLOAT32_MEMORY_SHARE = 0.5  # of the memory available at start, for float32 copies of the weights


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's ISA flags (empty where there is no /proc/cpuinfo)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def bfloat16_isa(flags: frozenset[str]) -> Optional[str]:
    """The hardware bfloat16 multiply these flags name, best first, or None."""
    if {"amx_bf16", "amx_tile"} <= flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return None


def fast_bfloat16_matmuls() -> Optional[str]:
    """The ISA this process's torch multiplies bfloat16 with in hardware (through oneDNN), or None."""
    import torch

    try:
        onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch without the probe: assume the fallback
        onednn = False
    return bfloat16_isa(cpu_flags()) if onednn else None


def checkpoint_bytes(model_dir: str) -> int:
    """The weight files' size (0 where there is no directory to look in)."""
    path = Path(model_dir) if model_dir else None
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


def choose_cpu_dtype(half: str, bfloat16_isa: Optional[str], float32_bytes: int,
                     available_bytes: int) -> tuple[str, str]:
    """(dtype, why) for a checkpoint in ``half`` precision: bfloat16 where the CPU multiplies it
    in hardware (``bfloat16_isa``), else float32 when its float32 weights fit the memory share,
    else bfloat16 anyway."""
    if bfloat16_isa:
        return "bfloat16", f"{half} checkpoint in bfloat16 (oneDNN multiplies it with {bfloat16_isa} on this CPU)"
    if float32_bytes > FLOAT32_MEMORY_SHARE * available_bytes:
        return "bfloat16", (f"{half} checkpoint kept in bfloat16, which this CPU multiplies slowly (no AMX or "
                            f"AVX512-BF16): its float32 weights ({float32_bytes / 2**30:.1f} GiB) "
                            f"would take more than half the {available_bytes / 2**30:.1f} GiB available")
    return "float32", (f"{half} checkpoint computed in float32: this CPU has no AMX or AVX512-BF16, where "
                       f"bfloat16 arithmetic is slower; --dtype bfloat16 keeps half the memory")


def cpu_dtype_for_half_checkpoint(half: str, model_dir: str, copies: int = 1) -> str:
    """``copies``: how many full copies of the weights this host will hold (one per replica)."""
    import psutil

    # A half-precision checkpoint holds 2 bytes a weight, float32 4.
    float32_bytes = 2 * checkpoint_bytes(model_dir) * max(1, copies)
    dtype, why = choose_cpu_dtype(half, fast_bfloat16_matmuls(), float32_bytes, psutil.virtual_memory().available)
    log.info("--dtype auto: %s", why)
    return dtype
