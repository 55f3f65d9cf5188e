"""What ``--dtype auto`` computes a half-precision checkpoint in on a CPU.

torch multiplies bfloat16 quickly on a CPU only through oneDNN, which takes it from AVX-512 up
(natively with AVX512-BF16 or AMX). Elsewhere (AVX2: every AMD CPU before Zen 4, most Intel
laptops) its fallback ran the steps of a 0.5B-shaped model 2.4-6.5x slower than float32
(bench/RESULTS.md). There ``auto`` computes in float32, as a user who measured would, as long as
the float32 weights take at most half the memory available: a model too large for that keeps
bfloat16 (slow, but it fits), and the log says so. Where oneDNN has bfloat16, ``auto`` keeps it,
as vLLM's CPU backend does. ``--dtype`` overrides either choice.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("pagedserve.dtype")

FLOAT32_MEMORY_SHARE = 0.5  # of the memory available at start, for float32 copies of the weights


def fast_bfloat16_matmuls() -> bool:
    """Whether this process's torch has its fast bfloat16 matmuls (oneDNN's) on this CPU."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume the fallback
        return False


def checkpoint_bytes(model_dir: str) -> int:
    """The weight files' size (0 where there is no directory to look in)."""
    path = Path(model_dir) if model_dir else None
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


def choose_cpu_dtype(half: str, fast_bfloat16: bool, float32_bytes: int, available_bytes: int) -> tuple[str, str]:
    """(dtype, why) for a checkpoint in ``half`` precision: bfloat16 where the CPU multiplies it
    fast, else float32 when its float32 weights fit the memory share, else bfloat16 anyway."""
    if fast_bfloat16:
        return "bfloat16", f"{half} checkpoint in bfloat16 (oneDNN multiplies it on this CPU)"
    if float32_bytes > FLOAT32_MEMORY_SHARE * available_bytes:
        return "bfloat16", (f"{half} checkpoint kept in bfloat16, which this CPU multiplies slowly (no oneDNN "
                            f"bfloat16 below AVX-512): its float32 weights ({float32_bytes / 2**30:.1f} GiB) "
                            f"would take more than half the {available_bytes / 2**30:.1f} GiB available")
    return "float32", (f"{half} checkpoint computed in float32: this CPU multiplies bfloat16 2-6x slower (no oneDNN "
                       f"bfloat16 below AVX-512); --dtype bfloat16 keeps half the memory")


def cpu_dtype_for_half_checkpoint(half: str, model_dir: str, copies: int = 1) -> str:
    """``copies``: how many full copies of the weights this host will hold (one per replica)."""
    import psutil

    # A half-precision checkpoint holds 2 bytes a weight, float32 4.
    float32_bytes = 2 * checkpoint_bytes(model_dir) * max(1, copies)
    dtype, why = choose_cpu_dtype(half, fast_bfloat16_matmuls(), float32_bytes, psutil.virtual_memory().available)
    log.info("--dtype auto: %s", why)
    return dtype
