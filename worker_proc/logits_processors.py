"""What a request's sampling parameters do to its logits before a token is chosen.

vLLM's semantics, in vLLM v1's order: logit_bias, then the penalties (repetition over prompt
and output tokens; frequency and presence over output tokens only), then (for sampled rows)
temperature and min_p. Greedy requests take the argmax after bias and penalties, so greedy
with a penalty equals transformers' greedy with the same processor. Every function works on
a batch of rows, touching only the rows whose request asked for the control.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.device_indices import host_values_to_device
from pagedserve.protocol.step_state import HeldRequest


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one [rows, longest] tensor (padding 0) and its validity mask."""
    width = max(max((len(r) for r in rows), default=0), 1)
    ids = host_values_to_device([r + [0] * (width - len(r)) for r in rows], torch.long, device)
    valid = host_values_to_device([[True] * len(r) + [False] * (width - len(r)) for r in rows], torch.bool, device)
    return ids, valid


def _counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each vocabulary entry occurs in each row: [rows, vocab] float32."""
    ids, valid = _padded(rows, device)
    counts = torch.zeros(len(rows), vocab, device=device)
    return counts.scatter_add_(1, ids, valid.to(counts.dtype))


def apply_logit_bias(logits: torch.Tensor, requests: list[HeldRequest]) -> None:
    """OpenAI's logit_bias: each named token's bias is added to its logit (in place)."""
    for row, req in enumerate(requests):
        bias = req.sampling.logit_bias
        if bias:
            ids = host_values_to_device(list(bias.keys()), torch.long, logits.device)
            values = host_values_to_device(list(bias.values()), logits.dtype, logits.device)
            logits[row].index_add_(0, ids, values)


def apply_penalties(logits: torch.Tensor, requests: list[HeldRequest]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that ask for them."""
    vocab = logits.shape[-1]
    rows = [i for i, r in enumerate(requests)
            if r.sampling.repetition_penalty != 1.0 or r.sampling.frequency_penalty != 0.0
            or r.sampling.presence_penalty != 0.0]
    if not rows:
        return
    device = logits.device
    chosen = [requests[i] for i in rows]
    index = host_values_to_device(rows, torch.long, device)
    sub = logits[index]
    outputs = _counts([r.token_ids[r.num_prompt_tokens:] for r in chosen], vocab, device)
    if any(r.sampling.repetition_penalty != 1.0 for r in chosen):
        seen = _counts([r.token_ids[:r.num_prompt_tokens] for r in chosen], vocab, device) + outputs > 0
        penalty = host_values_to_device([r.sampling.repetition_penalty for r in chosen], sub.dtype, device)[:, None]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, penalized, sub)
    frequency = host_values_to_device([r.sampling.frequency_penalty for r in chosen], sub.dtype, device)[:, None]
    presence = host_values_to_device([r.sampling.presence_penalty for r in chosen], sub.dtype, device)[:, None]
    sub = sub - frequency * outputs - presence * (outputs > 0).to(sub.dtype)
    logits[index] = sub


def apply_min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """vLLM's min_p: a token whose probability is below min_p times the row's highest is removed.
    ``scaled``: tempered logits; a row with min_p 0 is unchanged."""
    if not any(p > 0.0 for p in min_p):
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    threshold = host_values_to_device(min_p, probs.dtype, scaled.device)[:, None] * probs.amax(-1, keepdim=True)
    return scaled.masked_fill(probs < threshold, float("-inf"))


def top_logprobs(logits: torch.Tensor, requests: list[HeldRequest]) -> list[list[tuple[int, float]]]:
    """Each row's top_logprobs best (token id, logprob) pairs under the unmodified distribution."""
    wanted = [r.sampling.top_logprobs if r.sampling.logprobs else 0 for r in requests]
    k_max = min(max(wanted), logits.shape[-1])
    if k_max <= 0:
        return [[] for _ in requests]
    values, ids = torch.log_softmax(logits, dim=-1).topk(k_max, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[row][:k], values[row][:k])) for row, k in enumerate(wanted)]
