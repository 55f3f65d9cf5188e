"""The environment a deployment's processes set before torch loads (runtime/torch_env.py): torch's
large CPU tensors on huge pages, unless the operator says otherwise."""

from __future__ import annotations

import os
from pathlib import Path

from pagedserve.runtime.torch_env import apply_torch_env_defaults, huge_pages_state


def test_defaults_leave_the_operators_choice(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    apply_torch_env_defaults()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    apply_torch_env_defaults()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"



def test_the_log_says_whether_huge_pages_are_on(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert huge_pages_state() == "off (THP_MEM_ALLOC_ENABLE=0)"
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists():
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
        expected = "off (the kernel's THP mode is never)" if "[never]" in mode.read_text() else "on"
        assert huge_pages_state() == expected
