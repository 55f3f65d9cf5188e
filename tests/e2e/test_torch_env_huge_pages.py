"""torch's large CPU tensors on huge pages in a deployment's processes (protocol/torch_env.py),
seen in a fresh interpreter's own memory map, as a worker starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# A fresh interpreter, as a worker starts: the defaults, then torch, then a 64 MiB tensor written
# through; its process's anonymous huge pages, in kB.
CHILD = """
from pagedserve.protocol.torch_env import apply_torch_env_defaults
apply_torch_env_defaults()
import torch
x = torch.ones(16 << 20)
print(next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")))
"""


def huge_kb(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])



@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
                    reason="huge pages are asked for with madvise only where the kernel's THP mode is 'madvise'")
def test_a_workers_large_tensors_sit_on_huge_pages():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert huge_kb(env) >= 32 << 10  # most of the 64 MiB tensor
    assert huge_kb({**env, "THP_MEM_ALLOC_ENABLE": "0"}) < 2 << 10
