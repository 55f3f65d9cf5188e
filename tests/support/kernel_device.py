"""Where the Triton kernel tests run: the CPU interpreter (default) or a real CUDA GPU.

The interpreter checks the kernels' maths anywhere, but only a GPU runs the compiled code
that serves. tests/conftest.py imports this module before anything imports triton: the
interpreter is chosen when the kernels are decorated. On a GPU machine:

    PAGEDSERVE_TEST_DEVICE=cuda python -m pytest tests/unit/test_kernels_attention.py \
        tests/unit/test_kernels_blocks.py tests/unit/test_worker_triton_forward.py

Inputs are still drawn on the CPU from seeded generators, so both devices see the same
numbers; ``to_device`` moves them just before the kernel runs.
"""

import os

import pytest
import torch

DEVICE_ENV = "PAGEDSERVE_TEST_DEVICE"

_name = os.environ.get(DEVICE_ENV, "cpu").strip().lower()
if _name not in ("cpu", "cuda"):
    raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {_name!r}")
if _name == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
else:
    # A leftover TRITON_INTERPRET=1 would quietly run the interpreter on GPU tensors.
    os.environ.pop("TRITON_INTERPRET", None)

DEVICE = torch.device(_name)
# On a GPU each kernel's first launch compiles it in a subprocess (ptxas), and conftest fails
# any test that starts a process unless it is marked slow; test modules use this as pytestmark.
MARKS = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason=f"{DEVICE_ENV}=cuda but torch sees no CUDA device")
         ] if DEVICE.type == "cuda" else []


def to_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on DEVICE; on the CPU the very same objects, so in-place writes still show."""
    return tuple(tensor.to(DEVICE) for tensor in tensors)


def synchronize() -> None:
    """Wait for queued GPU work, e.g. a non-blocking copy into pinned host memory."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
