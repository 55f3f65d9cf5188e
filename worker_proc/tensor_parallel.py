"""Megatron-style tensor parallelism: which slice of each weight a rank holds, and the reduce.

q/k/v and gate/up are column-parallel (each rank owns whole attention heads and a slice
of the MLP's intermediate features); o_proj and down_proj are row-parallel, and their
partial outputs are summed with one all-reduce each. When there are fewer KV heads than
ranks, each rank keeps the one KV head its query heads read (KV heads are replicated).
With ``--enable-expert-parallel`` a mixture of experts' experts are placed whole instead
(``expert_parallel``; models/expert_parallel.py), and ``all_to_all`` exchanges their tokens.
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
    expert_parallel: bool = False  # whole experts per rank (models/expert_parallel.py), not a slice of each

    @classmethod
    def for_rank(cls, spec: ModelSpec, rank: int, size: int, group: Optional[Any] = None,
                 expert_parallel: bool = False) -> "TensorParallelShard":
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
        if expert_parallel:
            check_expert_parallel(spec, size)
        return cls(rank, size, heads, kv_heads, rank * heads, first_kv, inter, group, expert_parallel)

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

    def row_absmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's max |x| over the whole row, float32 [rows], where this rank's x [rows, in] is a row-parallel
        layer's slice of it: a token's scale in schemes that quantize it per token (W8A8, FP8)."""
        values = x.abs().amax(-1).float().contiguous()
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values

    def all_to_all(self, rows: torch.Tensor, receive: list[int], send: list[int]) -> torch.Tensor:
        """Rows ``send[r]`` at a time to rank r, in rank order; the rows every rank sent here
        (``receive[r]`` from rank r), in rank order."""
        import torch.distributed as dist

        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=self.group)
        return out

    def all_to_all_equal(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` cut into size equal parts, part r to rank r; the parts every rank sent here."""
        import torch.distributed as dist

        out = torch.empty_like(values)
        dist.all_to_all_single(out, values.contiguous(), group=self.group)
        return out


def check_expert_parallel(spec: ModelSpec, size: int) -> None:
    """``--enable-expert-parallel``'s own refusal, in one line: a model without routed experts, or a
    tensor-parallel size that does not divide them (deploy/serve_config.py refuses both before start)."""
    if spec.moe is None or not spec.moe.num_experts:
        raise UnsupportedModelError(f"--enable-expert-parallel: {spec.architecture} has no mixture of experts "
                                    "to place")
    if spec.moe.num_experts % size:
        raise UnsupportedModelError(f"--enable-expert-parallel: tensor-parallel size {size} does not divide the "
                                    f"{spec.moe.num_experts} experts; pick a tp_size that does")
