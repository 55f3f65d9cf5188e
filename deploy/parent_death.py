"""A child that dies with its parent, however the parent dies (SIGKILL included)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """In the child, after the fork: the kernel sends SIGKILL when ``parent_pid`` dies (strictly,
    the thread that forked). Linux only; elsewhere prctl is skipped."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
