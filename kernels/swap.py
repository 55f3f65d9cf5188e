"""Device <-> host block swapping as asynchronous copies of runs of consecutive blocks.

Why not gather + one copy (the reference): on swap-out the gathered blocks land in a host
buffer that must then be scattered into the host cache by the CPU, which has to wait for the
copy, i.e. for the whole stream. Copying each run straight into place keeps every copy on the
current stream and the host free. In the ``[layer, 0|1, block, ...]`` layout a run of n
consecutive blocks is one contiguous span per (layer, K|V), so a swap costs
``runs * 2 * num_layers`` copies; freshly allocated host/device blocks mostly come in runs.
With a pinned host cache each copy is an asynchronous DMA on the current stream.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cache_layout import check_kv_cache


def block_runs(mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both block ids step by one, in mapping order."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in mapping.reshape(-1, 2).tolist():
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor) -> None:
    """Copy block ``mapping[i, 0]`` of ``src_cache`` to block ``mapping[i, 1]`` of ``dst_cache``.

    Same contract as the reference. ``mapping`` should live on the host (reading it from a
    device would stall the stream). Copies are non-blocking only where that is safe: the
    host side must be pinned, otherwise CUDA itself makes them synchronous.
    """
    if mapping.numel() == 0:
        return
    check_kv_cache(src_cache)
    check_kv_cache(dst_cache)
    if src_cache.shape[3:] != dst_cache.shape[3:] or src_cache.shape[0] != dst_cache.shape[0]:
        raise ValueError(
            f"swap between caches of different block layouts: {tuple(src_cache.shape)} -> {tuple(dst_cache.shape)}"
        )
    src = src_cache.view(-1, *src_cache.shape[2:])  # [layer * 2, blocks, slot, head, dim]
    dst = dst_cache.view(-1, *dst_cache.shape[2:])
    non_blocking = src_cache.device.type == "cuda" or dst_cache.device.type == "cuda"
    runs = block_runs(mapping)
    for src_start, dst_start, length in runs:
        # Slicing would silently truncate an out-of-range run, so check the ids here.
        if min(src_start, dst_start) < 0 or src_start + length > src.shape[1] or dst_start + length > dst.shape[1]:
            raise IndexError(
                f"swap run {src_start}..{src_start + length - 1} -> {dst_start}..{dst_start + length - 1} "
                f"is outside the caches ({src.shape[1]} source, {dst.shape[1]} destination blocks)"
            )
    for src_start, dst_start, length in runs:
        for layer_kind in range(src.shape[0]):
            dst[layer_kind, dst_start : dst_start + length].copy_(
                src[layer_kind, src_start : src_start + length], non_blocking=non_blocking
            )
