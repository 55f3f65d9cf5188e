"""Moves a small host-side index tensor (block ids, block mappings) or a list of per-row values
(the sampler's) to the kernel's device.

The scheduler's lists arrive on the host. On CUDA they travel in one non-blocking copy from
pinned memory, so the host never waits for the stream; on CPU they are used as they are.
"""

from __future__ import annotations

import torch


def to_device_indices(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``indices`` as a contiguous int32 tensor on ``device``, copied once without blocking the host.

    ``Tensor.pin_memory`` draws from torch's caching host allocator, which records the
    pending copy on the current stream: the pinned buffer is not handed out again until the
    copy has run, so the host may build the next step's list at once.
    """
    indices = indices.to(torch.int32)
    if indices.device == device:
        return indices.contiguous()
    if device.type == "cuda" and indices.device.type == "cpu":
        return indices.contiguous().pin_memory().to(device, non_blocking=True)
    return indices.to(device).contiguous()


def host_values_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short list of per-row values (temperatures, row indices, uniforms) as a tensor on
    ``device``: on CUDA through pinned memory without blocking, where ``torch.tensor(values,
    device=...)`` or indexing with a list would make the host wait for every kernel queued
    before it (the forward, when the sampler runs)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
