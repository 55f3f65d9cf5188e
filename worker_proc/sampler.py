"""Turns logits into tokens: logit_bias -> penalties -> greedy, or temperature -> min_p ->
top-k -> top-p -> seeded sampling (logits_processors.py). Logprobs are of the raw logits.

Reproducibility: the randomness behind a request's k-th output token depends only on
(seed, k) — a CPU torch.Generator seeded with a 63-bit mix of the two draws an Exp(1)
noise vector q, and the token is argmax(probs / q) (the exponential race, equivalent to
sampling from probs). So a request's stream is the same whatever else shares its batch,
whether it was preempted and recomputed, and on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.logits_processors import apply_logit_bias, apply_min_p, apply_penalties, top_logprobs

_MASK64 = (1 << 64) - 1
GREEDY_TEMPERATURE = 1e-5  # at or below this, sampling is argmax


def noise_seed(seed: int, k: int) -> int:
    """A 63-bit splitmix64 mix of (seed, k): nearby pairs give unrelated generators."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (k & _MASK64) + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: Optional[list[float]]  # of the sampled token under the unmodified distribution
    # Per row, its request's top_logprobs alternatives (unmodified distribution); None: nobody asked
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k then top-p remove; rows keep at least their best token."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype)[:, None]
        sorted_logits = sorted_logits.masked_fill((mass_before > p) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _exponential_noise(requests: list[HeldRequest], vocab: int, device: torch.device) -> torch.Tensor:
    noise = torch.empty(len(requests), vocab)
    generator = torch.Generator(device="cpu")
    for row, req in enumerate(requests):
        generator.manual_seed(noise_seed(req.seed, req.num_output_tokens))
        noise[row].exponential_(generator=generator)
    return noise.to(device)


def sample(logits: torch.Tensor, requests: list[HeldRequest]) -> SamplerOutput:
    """logits: float32 [len(requests), vocab], one row per request in order; not modified."""
    if not requests:
        return SamplerOutput([], None)
    raw = logits
    if any(r.sampling.logit_bias for r in requests):
        logits = logits.clone()
        apply_logit_bias(logits, requests)
    if any(r.sampling.repetition_penalty != 1.0 or r.sampling.frequency_penalty != 0.0
           or r.sampling.presence_penalty != 0.0 for r in requests):
        logits = logits.clone() if logits is raw else logits
        apply_penalties(logits, requests)
    temperatures = [r.sampling.temperature for r in requests]
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, t in enumerate(temperatures) if t > GREEDY_TEMPERATURE]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        chosen = [requests[i] for i in random_rows]
        temps = torch.tensor([temperatures[i] for i in random_rows], device=logits.device)[:, None]
        scaled = apply_min_p(logits[rows] / temps, [r.sampling.min_p for r in chosen])
        top_k = [r.sampling.top_k for r in chosen]
        top_p = [r.sampling.top_p for r in chosen]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = _exponential_noise(chosen, logits.shape[-1], logits.device)
        token_ids[rows] = (probs / noise).argmax(dim=-1)
    logprobs = alternatives = None
    if any(r.sampling.logprobs for r in requests):  # vLLM's default: of the raw logits
        log_probs = torch.log_softmax(raw, dim=-1)
        logprobs = log_probs.gather(-1, token_ids[:, None]).squeeze(-1).tolist()
        if any(r.sampling.top_logprobs for r in requests):
            alternatives = top_logprobs(raw, requests)
    return SamplerOutput(token_ids.tolist(), logprobs, alternatives)
