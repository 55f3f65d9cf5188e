"""Megatron-style tensor parallelism: which slice of each weight a rank holds, and the reduce.

q/k/v and gate/up are column-parallel (each rank owns whole attention heads and a slice
of the MLP's intermediate features); o_proj and down_proj are row-parallel, and their
partial outputs are summed with one all-reduce each. When there are fewer KV heads than
ranks, each rank keeps the one KV head its query heads read (KV heads are replicated).
With one rank nothing here ever touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class TensorParallelShard:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    first_head: int
    first_kv_head: int
    intermediate_size: int  # MLP features on this rank
    group: Optional[Any] = None

    @classmethod
    def for_rank(cls, spec: ModelSpec, rank: int, size: int, group: Optional[Any] = None) -> "TensorParallelShard":
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tp_rank {rank} is not a rank of a tensor-parallel group of size {size}")
        if size > 1 and not spec.family.tensor_parallel:
            raise UnsupportedModelError(f"{spec.architecture} runs on one device per replica: --tensor-parallel-size "
                                        f"must be 1, got {size}")
        problems = []
        if spec.num_heads % size:
            problems.append(f"num_attention_heads={spec.num_heads}")
        if spec.num_kv_heads % size and size % spec.num_kv_heads:
            problems.append(f"num_key_value_heads={spec.num_kv_heads}")
        if spec.intermediate_size % size:
            problems.append(f"intermediate_size={spec.intermediate_size}")
        if problems:
            raise UnsupportedModelError(
                f"tensor-parallel size {size} does not divide {', '.join(problems)}; pick a tp_size that does"
            )
        heads = spec.num_heads // size
        if spec.num_kv_heads >= size:
            kv_heads, first_kv = spec.num_kv_heads // size, rank * (spec.num_kv_heads // size)
        else:
            kv_heads, first_kv = 1, rank * spec.num_kv_heads // size
        inter = spec.intermediate_size // size
        return cls(rank, size, heads, kv_heads, rank * heads, first_kv, inter, group)

    def head_rows(self, head_dim: int) -> tuple[int, int]:
        return self.first_head * head_dim, (self.first_head + self.num_heads) * head_dim

    def kv_head_rows(self, head_dim: int) -> tuple[int, int]:
        return self.first_kv_head * head_dim, (self.first_kv_head + self.num_kv_heads) * head_dim

    def intermediate_rows(self) -> tuple[int, int]:
        return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs across ranks (no-op for one rank)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(partial, group=self.group)
        return partial
