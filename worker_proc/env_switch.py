"""The worker's on/off environment switches (PAGEDSERVE_FUSED_OPS, PAGEDSERVE_CPU_PACKED_LINEAR, PAGEDSERVE_CPU_GEMV, PAGEDSERVE_PREPARE_AHEAD,
PAGEDSERVE_PRUNE_LAST_LAYER, PAGEDSERVE_EP_ALL_TO_ALL, PAGEDSERVE_HYBRID_KV, PAGEDSERVE_CPU_MOE_KERNEL)."""

from __future__ import annotations

import os
from typing import Optional


def env_switch(name: str) -> Optional[bool]:
    """True for ``1``, False for ``0``, None when unset or empty (the engine chooses); any other
    value is refused, so a misspelt switch is never silently taken as the default."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"
