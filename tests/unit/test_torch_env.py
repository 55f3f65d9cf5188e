"""The environment a deployment's processes set before torch loads (protocol/torch_env.py): torch's
large CPU tensors on huge pages, unless the operator says otherwise."""

from __future__ import annotations

import os

from pagedserve.protocol.torch_env import apply_torch_env_defaults


def test_defaults_leave_the_operators_choice(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    apply_torch_env_defaults()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    apply_torch_env_defaults()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
