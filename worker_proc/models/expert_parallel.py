"""``--enable-expert-parallel``: a mixture of experts' routed experts placed whole on the ranks of the
tensor-parallel group, rank r holding experts ``[r * E / tp, (r + 1) * E / tp)``, instead of a slice of
every expert's intermediate features (vLLM's flag of the same name).

Attention stays tensor-parallel, so after its all-reduce every rank holds every token's hidden state;
the router is replicated (every rank routes alike) and a shared expert stays sliced as before. Two ways
to bring each (token, expert) pair to its expert's owner and its output back:

- all-reduce combine (the default): every rank routes every token and runs its own experts over the
  pairs routed to them; the decoder layer's one all-reduce, which tensor parallelism runs anyway, sums
  the ranks' parts. No collective beyond TP's.
- all-to-all (``PAGEDSERVE_EP_ALL_TO_ALL=1``): rank r routes only its 1/tp slice of the step's tokens,
  sends each pair's hidden row to its expert's owner (``all_to_all_single``; the per-expert counts
  first), the owner runs its experts over what it received and sends the outputs back; rank r weighs and
  sums its tokens' outputs into its slice's rows, zeros elsewhere, and the layer's all-reduce, a sum of
  disjoint rows, gathers every token on every rank. Each expert row is computed once either way; this
  path also splits the routing and the combine over the ranks, at the price of three collectives.

On CPU with gloo the all-reduce combine is the faster (docs/DECISIONS.md, "Expert parallelism's
combine"; bench/scripts/ep_combine_bench.py). Both return the same rows up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedserve.worker_proc.env_switch import env_switch
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

ALL_TO_ALL_ENV = "PAGEDSERVE_EP_ALL_TO_ALL"  # 1: the all-to-all exchange; unset or 0: the all-reduce combine

# (x [T, H]) -> routing weights and expert ids [T, top_k] (models/moe.py's router)
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (rows [P, H] sorted by local expert, rows per local expert) -> each row's expert output [P, H], unweighted
Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Which experts this rank holds whole, and how their tokens reach them."""
    shard: TensorParallelShard
    num_experts: int
    first: int  # this rank's experts: [first, first + count)
    count: int
    all_to_all: bool

    @classmethod
    def of(cls, shard: TensorParallelShard, num_experts: int) -> Optional["ExpertPlacement"]:
        """None without expert parallelism, or on one rank (which holds every expert: the plain path)."""
        if not shard.expert_parallel or shard.size == 1:
            return None
        count = num_experts // shard.size  # TensorParallelShard.for_rank checked it divides
        return cls(shard, num_experts, shard.rank * count, count, env_switch(ALL_TO_ALL_ENV) is True)

    def describe(self) -> str:
        combine = "all-to-all exchange" if self.all_to_all else "all-reduce combine"
        return (f"expert parallel: rank {self.shard.rank} of {self.shard.size} holds experts {self.first}-"
                f"{self.first + self.count - 1} of {self.num_experts} whole; {combine}")

    def routed_output(self, x: torch.Tensor, route: Route, experts: Experts) -> torch.Tensor:
        """This rank's part of the routed experts' output [T, H]; the decoder layer's all-reduce sums the parts."""
        return self._exchanged(x, route, experts) if self.all_to_all else self._local(x, route, experts)

    def _local(self, x: torch.Tensor, route: Route, experts: Experts) -> torch.Tensor:
        weights, ids = route(x)
        flat = ids.reshape(-1)
        local = ((flat >= self.first) & (flat < self.first + self.count)).nonzero().squeeze(1)
        pairs = local[torch.argsort(flat[local], stable=True)]  # grouped by expert, a token's in order
        counts = torch.bincount(flat[pairs] - self.first, minlength=self.count).tolist()
        return _weighted_sum(x, experts(x[pairs // ids.shape[1]], counts), weights, pairs, ids.shape[1])

    def _exchanged(self, x: torch.Tensor, route: Route, experts: Experts) -> torch.Tensor:
        shard, size = self.shard, self.shard.size
        start, end = x.shape[0] * shard.rank // size, x.shape[0] * (shard.rank + 1) // size
        own = x[start:end]
        weights, ids = route(own)
        flat = ids.reshape(-1)
        pairs = torch.argsort(flat, stable=True)  # by expert, so by owner
        per_expert = torch.bincount(flat, minlength=self.num_experts)  # [owner, its experts], sent as counts
        received = shard.all_to_all_equal(per_expert).view(size, self.count)  # [source, my expert]
        send = per_expert.view(size, self.count).sum(1).tolist()
        receive = received.sum(1).tolist()
        rows = shard.all_to_all(own[pairs // ids.shape[1]], receive, send)
        # each source's rows come sorted by expert: one stable sort groups them all by expert
        sources_experts = torch.arange(self.count, device=x.device).repeat(size)
        expert_of = torch.repeat_interleave(sources_experts, received.reshape(-1))
        by_expert = torch.argsort(expert_of, stable=True)
        outputs = torch.empty_like(rows)
        outputs[by_expert] = experts(rows[by_expert], received.sum(0).tolist())
        returned = shard.all_to_all(outputs, send, receive)  # in the order this rank sent them
        out = torch.zeros_like(x)
        out[start:end] = _weighted_sum(own, returned, weights, pairs, ids.shape[1])
        return out


def _weighted_sum(x: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """Each pair's output times its routing weight (in the weight's dtype, then x's, as transformers
    does), added into its token's row; ``pairs``: each output row's index in the flat [T, top_k] routing."""
    scaled = (outputs * weights.reshape(-1)[pairs, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, pairs // top_k, scaled)
