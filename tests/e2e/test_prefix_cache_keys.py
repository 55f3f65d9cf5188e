"""Prefix-cache block keys (scheduler_proc/prefix_cache.py) do not depend on the interpreter's
hash seed: two fresh interpreters give the same key."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_block_keys_are_deterministic_across_processes():
    code = ("from array import array;"
            "from pagedserve.scheduler_proc.prefix_cache import block_key;"
            "first = block_key(0, array('q', [1, 2, 3, -4]).tobytes());"
            "print(block_key(first[2], array('q', [5, 6, 7, 8]).tobytes())[2])")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(runs) == 1 and runs.pop().strip()
