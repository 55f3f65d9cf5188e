"""The worker's KV-cache memory: a device cache, a host (swap) cache, and the block operations.

Layout (shared with kernels/): ``[num_layers, kinds, num_blocks, block_size, heads, head_dim]``, as
the model's ``KVCacheSpec`` declares it: two kinds (K and V) of this rank's KV heads, or, for
multi-head latent attention (DeepSeek-V2/V3), one kind of one head, the compressed latent row
(kv_lora_rank + rope dims) that keys and values are both read from, the same on every rank. The
scheduler counts blocks in tokens and never sees the difference: the worker sizes a block from
the spec (``block_bytes``) and reports how many fit. Block operations run in the order the design
fixes — swap out, swap in, copy, zero — on the current stream, before the forward pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

from pagedserve.worker_proc.host_memory import without_huge_pages

log = logging.getLogger(__name__)

CPU_DEFAULT_BUDGET_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one layer keeps per token in this rank's cache (compare vLLM's ``KVCacheSpec``)."""
    kinds: int  # 2: K and V; 1: a latent that keys and values are both read from
    heads: int
    head_dim: int

    @classmethod
    def per_head(cls, num_kv_heads: int, head_dim: int) -> "KVCacheSpec":
        return cls(2, num_kv_heads, head_dim)

    @classmethod
    def latent(cls, width: int) -> "KVCacheSpec":
        """Multi-head latent attention's one row per token (kv_lora_rank + qk_rope_head_dim)."""
        return cls(1, 1, width)


def block_bytes(num_layers: int, block_size: int, spec: KVCacheSpec, dtype: torch.dtype) -> int:
    """Bytes of one block: every layer, each kind the spec keeps."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return num_layers * spec.kinds * block_size * spec.heads * spec.head_dim * element_bytes


def max_num_blocks(bytes_per_block: int, device: torch.device, memory_bytes: Optional[int],
                   activation_headroom_bytes: int, memory_utilization: Optional[float] = None) -> int:
    """How many blocks fit: in ``memory_bytes`` when given; else, with ``memory_utilization``
    (vLLM's --gpu-memory-utilization), on CUDA in that share of the device's total memory
    less what is already used (these weights, other processes) and the activations
    headroom, on CPU in that share of the host's RAM; else in 90% of free CUDA memory less
    the headroom (weights are already resident), or 1 GiB on CPU."""
    if memory_bytes is not None:
        budget = memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if memory_utilization is None:
            budget = int(free * GPU_MEMORY_FRACTION) - activation_headroom_bytes
        else:
            budget = int(total * memory_utilization) - (total - free) - activation_headroom_bytes
    elif memory_utilization is not None:
        import psutil

        budget = int(psutil.virtual_memory().total * memory_utilization)
    else:
        budget = CPU_DEFAULT_BUDGET_BYTES
    return max(0, budget // bytes_per_block)


def warn_if_beyond_available_memory(cache_bytes: int) -> bool:
    """An unwritten cache becomes resident only as it fills, so a budget beyond the host's
    memory would not fail at start but kill the worker later, under load: say so now."""
    import psutil

    available = psutil.virtual_memory().available
    if cache_bytes <= available:
        return False
    log.warning("the KV caches in host memory take %.1f GiB once full, and %.1f GiB is available: the "
                "worker may be killed as they fill; lower --kv-cache-memory-gib, --gpu-memory-utilization, "
                "--num-gpu-blocks or --swap-space", cache_bytes / (1 << 30), available / (1 << 30))
    return True


def _pairs(pairs: list[tuple[int, int]] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.long).view(-1, 2)


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


class KVCache:
    def __init__(self, num_layers: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, ops: ModuleType):
        self.block_size, self.device, self.ops = block_size, device, ops
        shape = (num_layers, spec.kinds)
        tail = (block_size, spec.heads, spec.head_dim)
        # Not zeroed here: the scheduler zeroes every block before its first write (the
        # design's zeroing rule, poisoned-cache tests), and the host cache is only read where a
        # swap-out wrote it. Writing zeros over the default 1 GiB + 1 GiB on a CPU took 1-3.5 s
        # of every start; on CUDA the device memset is milliseconds and is kept.
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.device_cache = alloc(*shape, num_gpu_blocks, *tail, dtype=dtype, device=device)
        self.host_cache = torch.empty(*shape, num_cpu_blocks, *tail, dtype=dtype,
                                      pin_memory=device.type == "cuda")
        if device.type == "cpu":
            without_huge_pages(self.device_cache.data_ptr(), self.device_cache.nbytes)
            # Only here: CUDA's host cache is pinned, so resident (and counted) from the start.
            warn_if_beyond_available_memory(self.device_cache.nbytes + self.host_cache.nbytes)

    def apply_block_ops(self, swap_out: list, swap_in: list, copy: list, zero: list[int]) -> None:
        """Swap out, swap in, copy, zero, in that order."""
        # a float8 cache (--kv-cache-dtype fp8) moves and zeroes as its bytes: torch has no float8 index ops
        device, host = (_as_bytes(self.device_cache), _as_bytes(self.host_cache))
        if swap_out:
            self.ops.swap_blocks(device, host, _pairs(swap_out))
        if swap_in:
            self.ops.swap_blocks(host, device, _pairs(swap_in))
        if copy:
            self.ops.copy_blocks(device, _pairs(copy))  # the kernel moves its ids (pinned)
        if zero:
            self.ops.zero_blocks(device, torch.tensor(zero, dtype=torch.long))
