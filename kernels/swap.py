"""Device <-> host block swapping as asynchronous copies of runs of consecutive blocks.

Why not gather + one copy (the reference): on swap-out the gathered blocks land in a host
buffer that must then be scattered into the host cache by the CPU, which has to wait for the
copy, i.e. for the whole stream. Copying runs straight into place keeps every copy on the
current stream and the host free. In the ``[layer, 0|1, block, ...]`` layout a run of n
consecutive blocks is one contiguous span per (layer, K|V), so a swap costs
``runs * 2 * num_layers`` copies. With a pinned host cache each is an asynchronous DMA.

A run needs both sides consecutive. The device side often is not (a sequence's blocks are
wherever the pool had them; on an H100, 128 scattered blocks of Llama-8B took 8192 copies of
32 KB, 154 ms: bench/log/2026-11-25.md), while host blocks, allocated together, mostly are. So when
it saves copies, the device side is staged: on swap-out the blocks are gathered on the device
in host order (one kernel), then copied in runs of the host side alone; on swap-in they are
copied in host runs into a device buffer, then scattered into place (one kernel). Staging
takes at most STAGE_BYTES of device memory at a time.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cache_layout import check_kv_cache
from pagedserve.kernels.device_indices import to_device_indices

STAGE_BYTES = 256 << 20


def block_runs(mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both block ids step by one, in mapping order."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in mapping.reshape(-1, 2).tolist():
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _sorted_by(mapping: torch.Tensor, side: int) -> torch.Tensor:
    return mapping[torch.argsort(mapping[:, side], stable=True)]


def _run_count(ids: list[int]) -> int:
    """Runs of consecutive ids in sorted ``ids``."""
    return sum(1 for i, block in enumerate(ids) if i == 0 or block != ids[i - 1] + 1)


def swap_plan(mapping: torch.Tensor, may_gather: bool, may_scatter: bool) -> str:
    """``direct`` (runs of both sides), ``gather`` (at the source, runs of the destination) or
    ``scatter`` (runs of the source, at the destination): whichever makes fewest copies."""
    costs = {"direct": len(block_runs(mapping))}
    if may_gather:
        costs["gather"] = _run_count(sorted(mapping[:, 1].tolist()))
    if may_scatter:
        costs["scatter"] = _run_count(sorted(mapping[:, 0].tolist()))
    return min(costs, key=lambda kind: (costs[kind], kind != "direct"))


def _copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]], non_blocking: bool) -> None:
    for src_start, dst_start, length in runs:
        for layer_kind in range(src.shape[0]):
            dst[layer_kind, dst_start : dst_start + length].copy_(
                src[layer_kind, src_start : src_start + length], non_blocking=non_blocking
            )


def _check_runs(runs: list[tuple[int, int, int]], src_blocks: int, dst_blocks: int) -> None:
    for src_start, dst_start, length in runs:
        # Slicing would silently truncate an out-of-range run, so check the ids here.
        if min(src_start, dst_start) < 0 or src_start + length > src_blocks or dst_start + length > dst_blocks:
            raise IndexError(
                f"swap run {src_start}..{src_start + length - 1} -> {dst_start}..{dst_start + length - 1} "
                f"is outside the caches ({src_blocks} source, {dst_blocks} destination blocks)"
            )


def _staged(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, kind: str, non_blocking: bool) -> None:
    """One chunk: ``gather`` stages on the source's device, ``scatter`` on the destination's."""
    pairs = _sorted_by(mapping, 1 if kind == "gather" else 0)
    index = torch.arange(len(pairs))
    if kind == "gather":
        staged = src.index_select(1, to_device_indices(pairs[:, 0], src.device))
        _copy_runs(staged, dst, block_runs(torch.stack([index, pairs[:, 1]], 1)), non_blocking)
    else:
        staged = torch.empty((src.shape[0], len(pairs), *src.shape[2:]), dtype=dst.dtype, device=dst.device)
        _copy_runs(src, staged, block_runs(torch.stack([pairs[:, 0], index], 1)), non_blocking)
        dst.index_copy_(1, to_device_indices(pairs[:, 1], dst.device).long(), staged)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, mapping: torch.Tensor,
                staging: bool = True) -> None:
    """Copy block ``mapping[i, 0]`` of ``src_cache`` to block ``mapping[i, 1]`` of ``dst_cache``.

    Same contract as the reference (``staging=False``: runs of both sides only, for benches).
    ``mapping`` should live on the host (reading it from a device would stall the stream).
    Copies are non-blocking only where that is safe: the host side must be pinned, otherwise
    CUDA itself makes them synchronous.
    """
    if mapping.numel() == 0:
        return
    block_numel = check_kv_cache(src_cache)
    check_kv_cache(dst_cache)
    if src_cache.shape[3:] != dst_cache.shape[3:] or src_cache.shape[0] != dst_cache.shape[0]:
        raise ValueError(
            f"swap between caches of different block layouts: {tuple(src_cache.shape)} -> {tuple(dst_cache.shape)}"
        )
    src = src_cache.view(-1, *src_cache.shape[2:])  # [layer * 2, blocks, slot, head, dim]
    dst = dst_cache.view(-1, *dst_cache.shape[2:])
    mapping = mapping.reshape(-1, 2).long().cpu()
    runs = block_runs(mapping)
    _check_runs(runs, src.shape[1], dst.shape[1])
    non_blocking = src_cache.device.type == "cuda" or dst_cache.device.type == "cuda"
    # Stage only on a device (or where both sides are the CPU): staging in host memory would
    # make the host wait for the copy.
    src_host, dst_host = src_cache.device.type == "cpu", dst_cache.device.type == "cpu"
    kind = swap_plan(mapping, may_gather=staging and (not src_host or dst_host),
                     may_scatter=staging and (not dst_host or src_host))
    if kind == "direct":
        _copy_runs(src, dst, runs, non_blocking)
        return
    chunk = max(1, STAGE_BYTES // (src.shape[0] * block_numel * src.element_size()))
    for start in range(0, len(mapping), chunk):
        _staged(src, dst, mapping[start:start + chunk], kind, non_blocking)
