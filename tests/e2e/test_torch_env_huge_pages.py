"""torch's large CPU tensors on huge pages in a deployment's processes (runtime/torch_env.py),
but not the CPU KV cache (worker_proc/kv_cache.py), seen in a fresh interpreter's own memory
map, as a worker starts."""

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
from pagedserve.runtime.torch_env import apply_torch_env_defaults
apply_torch_env_defaults()
import torch
x = torch.ones(16 << 20)
print(next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")))
"""


# The same, with the worker's CPU KV cache (64 MiB) written through in place of the tensor.
KV_CHILD = CHILD.replace("x = torch.ones(16 << 20)", """
from pagedserve.kernels import reference
from pagedserve.worker_proc.kv_cache import KVCache, KVCacheSpec
cache = KVCache(4, 256, 1, 16, KVCacheSpec.per_head(4, 64), torch.float32, torch.device("cpu"), reference)
cache.device_cache.fill_(1.0)
""")


def huge_kb(env: dict, child: str = CHILD) -> int:
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])



@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
                    reason="huge pages are asked for with madvise only where the kernel's THP mode is 'madvise'")
def test_a_workers_large_tensors_sit_on_huge_pages():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert huge_kb(env) >= 32 << 10  # most of the 64 MiB tensor
    assert huge_kb({**env, "THP_MEM_ALLOC_ENABLE": "0"}) < 2 << 10


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="this kernel has no huge pages")
def test_the_cpu_kv_cache_stays_on_small_pages():
    # Its fresh blocks are first written a few at a time: a huge page would fault in 2 MiB for
    # each 8 KiB block (bench/log/2026-11-28.md "CPU: the KV cache on small pages").
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert huge_kb(env, KV_CHILD) < 2 << 10
