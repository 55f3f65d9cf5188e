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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RoutingRule:
    top_k: int
    renormalize: bool = False  # divide the top-k probabilities by their sum
    weights_in_float32: bool = False  # False: the weights are rounded to the logits' dtype
    softmax_after_topk: bool = False  # top-k over the logits, then a softmax over those k


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
