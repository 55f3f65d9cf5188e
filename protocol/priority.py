"""Request priority: its range, the scheduling policies, and the one rule every edge applies.

A request's ``priority`` is an integer, lower first (vLLM's convention), 0 by default. Only
``--scheduling-policy priority`` orders by it; under ``fcfs`` a non-zero priority would be
accepted and ignored, so every edge (HTTP, the offline ``LLM``, the scheduler for callers
that speak the protocol directly) refuses it with the same words, vLLM's.
"""

from __future__ import annotations

from typing import Optional

SCHEDULING_POLICIES = ("fcfs", "priority")
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1


def priority_refusal(policy: str, priority: int) -> Optional[str]:
    """Why a request of ``priority`` cannot be served under ``policy``, or None."""
    if priority != 0 and policy != "priority":
        return (f"priority={priority}: a non-zero priority is only supported with "
                f"--scheduling-policy priority (this server schedules {policy})")
    return None
