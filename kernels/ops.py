"""Chooses the kernel implementation once per process: Triton on CUDA, torch references otherwise.

``PAGEDSERVE_KERNELS=triton|torch`` overrides the choice. With ``TRITON_INTERPRET=1`` set
before the first import of triton, ``triton`` runs the Triton kernels on CPU (slowly), which
is how the tests check them against the references.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from pagedserve.kernels import reference

KERNELS_ENV = "PAGEDSERVE_KERNELS"


class KernelSelectionError(RuntimeError):
    """The requested kernel implementation cannot be used in this environment."""


def _triton_ops() -> ModuleType:
    from pagedserve.kernels import triton_ops  # imports triton; deferred so CPU workers never need it

    return triton_ops


def select_ops(device: torch.device | str) -> ModuleType:
    """A module exposing zero_blocks, copy_blocks, swap_blocks, write_kv, paged_attention."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower()
    if choice == "torch":
        return reference
    if choice == "triton":
        if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise KernelSelectionError(
                f"{KERNELS_ENV}=triton on CPU needs TRITON_INTERPRET=1 set before triton is imported"
            )
        try:
            return _triton_ops()
        except ImportError as error:
            raise KernelSelectionError(
                f"{KERNELS_ENV}=triton but triton cannot be imported ({error}); "
                "install pagedserve[triton] or set it to torch"
            ) from error
    if choice:
        raise KernelSelectionError(f"{KERNELS_ENV} must be 'triton' or 'torch', got {choice!r}")
    if torch.device(device).type != "cuda":
        return reference
    try:
        return _triton_ops()
    except ImportError:
        return reference
