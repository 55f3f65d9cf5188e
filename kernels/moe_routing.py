"""Mixture-of-experts routing, the one place it is computed: router logits -> top-k experts and weights.

Every MoE path (the CPU grouped experts, the Triton fused_moe, the torch reference) takes the
result of ``route``, so a family's routing is written once and checked once against transformers'
own router module (tests/unit/test_kernels_moe.py). transformers 5.25 routes all three supported
families the same way, softmax over every expert (in float32) then top-k, and they differ in two
switches:

- renormalisation: Mixtral always divides the top-k probabilities by their sum (the same numbers as
  a softmax over the top-k logits, which is how Mixtral's paper writes it); Qwen2-MoE and Qwen3-MoE
  do so only with ``norm_topk_prob``;
- the weights' dtype: Mixtral keeps them in float32 (a half-precision expert output is widened for
  the weighted sum and rounded once when added), the Qwen families round them to the model's dtype.

``softmax_after_topk`` covers the families that take the top-k logits first and softmax only
those (gpt-oss, whose router adds a bias to its logits; a rule of its own, since it differs from
renormalisation in the last bits).

DeepSeek's routers (``GroupedRouting``) differ more: the logits in float32 from a float32 router,
scores by a softmax (V2) or a sigmoid plus ``e_score_correction_bias`` that steers the choice but
not the weights (V3), the choice limited to the ``topk_group`` best of ``n_group`` groups of experts
(a group's score: its best expert's, V2's group_limited_greedy; its two best summed, V3), then
``norm_topk_prob`` (V3) and ``routed_scaling_factor``; the weights stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, slots=True)
class RoutingRule:
    top_k: int
    renormalize: bool = False  # divide the top-k probabilities by their sum
    weights_in_float32: bool = False  # False: the weights are rounded to the logits' dtype
    softmax_after_topk: bool = False  # top-k over the logits, then a softmax over those k


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """DeepSeek-V2 / V3's router (``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``)."""
    top_k: int
    sigmoid: bool  # V3: sigmoid scores, the correction bias added for the choice; V2: softmax
    num_groups: int = 1  # 1: every expert may be chosen (V2's "greedy")
    topk_groups: int = 1
    group_score_top: int = 1  # a group's score: the sum of its best this many scores (V2 1, V3 2)
    renormalize: bool = False  # V3's norm_topk_prob
    scaling: float = 1.0  # routed_scaling_factor
    weights_in_float32: bool = True

    def route(self, router_logits: torch.Tensor,
              correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 router_logits [T, E] -> (float32 weights [T, top_k], ids [T, top_k]), op for op."""
        scores = router_logits.sigmoid() if self.sigmoid else router_logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores if correction_bias is None else scores + correction_bias
        if self.num_groups > 1:
            tokens, experts = choice.shape
            grouped = choice.view(tokens, self.num_groups, experts // self.num_groups)
            group_scores = (grouped.max(dim=-1).values if self.group_score_top == 1
                            else grouped.topk(self.group_score_top, dim=-1)[0].sum(dim=-1))
            group_idx = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_groups, experts // self.num_groups)
            # V3 masks with -inf, V2 with 0.0 (its scores are positive probabilities)
            choice = choice.masked_fill(~score_mask.reshape(tokens, experts).bool(),
                                        float("-inf") if self.sigmoid else 0.0)
        if self.sigmoid:
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.scaling, ids


def route(router_logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (in the model's dtype, as the router's linear gives them) ->
    (weights [T, top_k], expert ids [T, top_k] int64), transformers' op for op."""
    if rule.softmax_after_topk:
        top_logits, ids = torch.topk(router_logits, rule.top_k, dim=-1)
        weights = torch.softmax(top_logits.float(), dim=-1)
    else:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, rule.top_k, dim=-1)
        if rule.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
    if not rule.weights_in_float32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


@dataclass(frozen=True, slots=True)
class ExpertOrder:
    """A step's (token, slot) pairs sorted by expert; within an expert by slot, then token (the
    rows transformers' experts loop multiplies, in its order)."""
    token_of: torch.Tensor  # [T * top_k] int64: the token of each sorted pair
    pair: torch.Tensor  # [T * top_k] int64: the pair's index in the flattened [T, top_k] routing
    counts: list[int]  # pairs per expert, [E]: an expert's pairs are one contiguous run


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """The pairs of ``ids`` [T, top_k] grouped by expert, expert 0 first (the CPU grouped path:
    one matmul per active expert over a contiguous run of rows)."""
    tokens, top_k = ids.shape
    by_slot = torch.argsort(ids.t().reshape(-1), stable=True)  # index into the slot-major [top_k, T]
    token_of, slot = by_slot % tokens, by_slot // tokens
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
    return ExpertOrder(token_of, token_of * top_k + slot, counts)
