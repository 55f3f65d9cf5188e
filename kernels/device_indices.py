"""Moves a small host-side index tensor (block ids, block mappings) or a list of per-row values
(the sampler's) to the kernel's device.

The scheduler's lists arrive on the host. On CUDA they travel in one non-blocking copy from
pinned memory, so the host never waits for the stream; on CPU they are used as they are.
"""

from __future__ import annotations

import torch


def to_device_indices(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``indices`` as a contiguous int32 tensor on ``device``, copied once without blocking the host."""
    indices = indices.to(torch.int32)
    if indices.device == device:
        return indices.contiguous()
    if indices.device.type == "cpu":
        return _from_host(indices.contiguous(), device)
    return indices.to(device).contiguous()


def host_values_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short list of per-row values (temperatures, row indices, noise keys) as a tensor on
    ``device``, where ``torch.tensor(values, device=...)`` or indexing with a list would make the
    host wait for every kernel queued before it (the forward, when the sampler runs)."""
    return _from_host(torch.tensor(values, dtype=dtype), device)


def _from_host(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA one non-blocking copy from pinned memory.

    ``Tensor.pin_memory`` draws from torch's caching host allocator, which records the
    pending copy on the current stream: the pinned buffer is not handed out again until the
    copy has run, so the host may build the next step's list at once.
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
