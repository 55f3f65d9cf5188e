"""What the scheduling policies read from a request: its priority, time limits and tenant,
their ranges, the policies' names, and the one refusal every edge applies.

A request's ``priority`` is an integer, lower first (vLLM's convention), 0 by default. Only the
``priority`` and ``deadline`` policies order by it; under ``fcfs`` and ``fair`` a non-zero
priority would be accepted and ignored, so every edge (HTTP, the offline ``LLM``, the scheduler
for callers that speak the protocol directly) refuses it with the same words, vLLM's.

Time limits are seconds from the request's arrival at its scheduler: ``max_queue_time_s`` bounds
the wait for its first token (with the server's ``--max-queue-time-s``: the smaller wins), and
``deadline_s`` bounds its whole generation (scheduler_proc/deadlines.py). ``tenant`` names whose
share a request counts against under ``fair`` (the frontend decides it, frontend_proc/tenant.py).
"""

from __future__ import annotations

from typing import Optional

SCHEDULING_POLICIES = ("fcfs", "priority", "deadline", "fair")
POLICIES_WITH_PRIORITY = ("priority", "deadline")
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1
MAX_LIMIT_S = 1e9  # about 32 years: finite, so every limit is a number the heap can order
MAX_TENANT_CHARS = 256
MAX_TENANT_KEYS = 256  # per-tenant stats keep this many tenants, then one OTHER_TENANTS key
OTHER_TENANTS = "(other)"
QUEUE_TIMEOUT = "queue_timeout"  # RequestDelta.error_kind of a request past its first-token limit


def priority_refusal(policy: str, priority: int) -> Optional[str]:
    """Why a request of ``priority`` cannot be served under ``policy``, or None."""
    if priority != 0 and policy not in POLICIES_WITH_PRIORITY:
        return (f"priority={priority}: a non-zero priority is only supported with "
                f"--scheduling-policy priority or deadline (this server schedules {policy})")
    return None


def parse_tenant_weights(value: str) -> dict[str, float]:
    """``--tenant-weights``: ``NAME=WEIGHT[,NAME=WEIGHT...]``, or the path of a JSON file holding
    ``{"NAME": WEIGHT}``; a weight is a positive number, a tenant not named weighs 1. Raises
    ValueError naming what is wrong."""
    import json
    import os

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{value}: not a JSON file of tenant weights ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{value}: expected a JSON object {{\"tenant\": weight}}")
        pairs = list(raw.items())
    else:
        pairs = []
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, weight = item.rpartition("=")
            if not sep:
                raise ValueError(f"{item!r} is not NAME=WEIGHT (and {value!r} is not a file)")
            pairs.append((name, weight))
    weights = {}
    for name, weight in pairs:
        try:
            number = float(weight)
        except (TypeError, ValueError):
            number = float("nan")
        if not isinstance(name, str) or len(name) > MAX_TENANT_CHARS or not 0 < number < 1e9:
            raise ValueError(f"tenant {name!r}: the weight must be a positive number, got {weight!r}")
        weights[name] = number
    return weights


def tenant_weights_text(weights: dict[str, float]) -> str:
    """The inline spelling of ``weights`` (what a trace records, so a replay needs no file)."""
    return ",".join(f"{name}={weight!r}" for name, weight in sorted(weights.items()))
