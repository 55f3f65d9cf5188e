"""Turns logits into tokens: logit_bias -> penalties -> greedy, or temperature -> min_p ->
top-k -> top-p -> seeded sampling (logits_processors.py). Logprobs are of the raw logits.

Reproducibility: the randomness behind a request's k-th output token depends only on
(seed, k): their 63-bit mix keys a counter-based stream of Exp(1) draws (splitmix64 in int64
tensor arithmetic: the same integers on any device), and the token wins an exponential race,
argmax(probs / q), equivalent to sampling from probs. The race runs in two levels: over
chunks of CHUNK tokens by their mass, then over the winning chunk's tokens, which is the same
distribution from C + CHUNK draws a row instead of one per vocabulary entry. So a request's
stream is the same whatever else shares its batch, whether it was preempted and recomputed,
and on any device. Unlike inverse transform sampling from one uniform, which moves a token
wherever the mass before it moves, the race moves one only where the logits' rounding (another
batch shape) changes which of two ratios is larger.

Before (protocol 11) a seeded CPU generator drew a whole Exp(1) vector a row: ~32 ns a
vocabulary entry, 5 ms a row of a 152k vocabulary; 156 ms a step at 32 sampled rows, half a
0.5B model's decode step on a CPU, and 1.2 s at 256 rows on a GPU's host (bench/log/2026-11-28.md
"CPU: sampling at a temperature").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels.device_indices import host_values_to_device
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.logits_processors import (
    apply_logit_bias, apply_min_p, apply_min_tokens, apply_penalties, holds_back_stops, top_logprobs)

_MASK64 = (1 << 64) - 1
GREEDY_TEMPERATURE = 1e-5  # at or below this, sampling is argmax
CHUNK = 128  # race_sample's first level: a 152k vocabulary races as 1187 chunks
TOP_CANDIDATES = 1024  # a CPU row's best tokens that top-k and top-p are decided among, where they can be


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


# Every tensor here is [rows, vocab]: dims are written as 1 (not -1) so that a slip to another
# dim fails loudly; per-row values reach the logits' device through host_values_to_device, which
# does not make the host wait for the forward on CUDA.


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k then top-p remove; rows keep at least their best token.
    Ties are ranked by token id (a stable sort), so which of equal tokens survive is fixed."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and vocab > TOP_CANDIDATES:
        masked = _from_candidates(logits, top_k, top_p)
        if masked is not None:
            return masked
    sorted_logits, order = torch.sort(logits, dim=1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = host_values_to_device([k if k > 0 else vocab for k in top_k], order.dtype, logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, -torch.inf)
    if any(p < 1.0 for p in top_p):  # skipped at p = 1: rounding in the cumsum could cut the tail
        probs = torch.softmax(sorted_logits, 1)
        # the best token's mass_before is exactly 0, never above p: every row keeps it
        mass_before = torch.cumsum(probs, 1) - probs
        # a row at p = 1 keeps every token even where the running mass rounds past 1
        top_p_rows = host_values_to_device([p if p < 1.0 else torch.inf for p in top_p], probs.dtype,
                                           probs.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p_rows, -torch.inf)
    return torch.empty_like(logits).scatter(1, order, sorted_logits)  # order is a permutation: fills all


def _from_candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> Optional[torch.Tensor]:
    """_apply_top_k_top_p's result from each row's best tokens, where they decide it, instead of
    a sort of the whole row (a 152k row: ~10 ms on a CPU; 32 of them cost more than a 0.5B decode
    step, and a model's generation_config often sets top-k and top-p for every request). The
    best max(top-k) where every row has a top-k, else TOP_CANDIDATES: they decide it when each
    row cuts at its top-k inside them or has more than its top-p of the mass in them, and no tie
    straddles their last place; else None (the CPU syncs are free)."""
    width = max(top_k) if all(k > 0 for k in top_k) else TOP_CANDIDATES
    if width > TOP_CANDIDATES:
        return None
    values, ids = torch.topk(logits, width + 1, dim=1)  # best first, ties in no set order
    if bool((values[:, width - 1] == values[:, width]).any()):  # the next token ties the last: which stays?
        return None
    values, ids = values[:, :width], ids[:, :width]
    ids, by_id = ids.sort(1)  # ties ranked by token id, as the whole row's stable sort ranks them
    values, order = values.gather(1, by_id).sort(dim=1, descending=True, stable=True)
    ids = ids.gather(1, order)
    limited = torch.tensor([k > 0 for k in top_k])[:, None]
    k = torch.tensor([k if k > 0 else width for k in top_k])[:, None]
    values = values.masked_fill(torch.arange(width)[None, :] >= k, -torch.inf)
    if any(p < 1.0 for p in top_p):
        # over what top-k keeps (all of it is here), or over the whole row
        norm = torch.logsumexp(values, 1, keepdim=True)
        if not bool(limited.all()):
            norm = torch.where(limited, norm, torch.logsumexp(logits, 1, keepdim=True))
        probs = torch.exp(values - norm)
        p = torch.tensor([p if p < 1.0 else torch.inf for p in top_p], dtype=probs.dtype)[:, None]
        if bool((~limited & (p < 1.0) & (probs.sum(1, keepdim=True) <= p)).any()):
            return None  # its cut may lie past the candidates
        values = values.masked_fill(torch.cumsum(probs, 1) - probs > p, -torch.inf)
    out = torch.full_like(logits, -torch.inf).scatter_(1, ids, values)
    untouched = [row for row, (k, p) in enumerate(zip(top_k, top_p)) if k <= 0 and p >= 1.0]
    if untouched:
        out[untouched] = logits[untouched]
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the first maximum (NaN counts as the maximum), as argmax(1):
    max(1) returns the same indices and on CPU takes about half argmax's time (a 64-row
    step of a 32k vocabulary: ~1.2 ms against ~5.9 ms on one thread)."""
    return x.max(1).indices


def _int64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with its bits (torch's integers are signed)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def exponential_noise(keys: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n] float64 Exp(1) draws, entry j of row r a function of (keys[r], j) alone: the
    splitmix64 generator's output j + 1 from state keys[r], in int64 arithmetic that wraps as
    unsigned arithmetic does; its top 53 bits are u in [0, 1) and the draw -log(1 - u)."""
    x = keys[:, None] + torch.arange(1, n + 1, device=keys.device) * _int64(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _int64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _int64(0x94D049BB133111EB)
    x = x ^ _shr(x, 31)
    return -torch.log1p(-(_shr(x, 11).double() * 2.0 ** -53))


def _race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per row, argmax(weight / noise) over the positive weights: index i with probability
    weights[i] / their sum. A weight of 0 (a masked token, an empty chunk) never wins."""
    return argmax_rows(torch.where(weights > 0, weights / noise, -1.0))


def race_sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row, a token drawn from ``probs`` [rows, vocab] (>= 0, any total) with the noise of
    ``keys`` [rows] int64: a chunk by the race of the chunks' masses, then a token of it."""
    rows, vocab = probs.shape
    if vocab % CHUNK:
        probs = F.pad(probs, (0, CHUNK - vocab % CHUNK))
    chunks = probs.view(rows, -1, CHUNK)
    mass = chunks.sum(2)
    noise = exponential_noise(keys, mass.shape[1] + CHUNK)
    chunk = _race(mass, noise[:, :mass.shape[1]])
    inside = chunks[torch.arange(rows, device=probs.device), chunk]
    return chunk * CHUNK + _race(inside, noise[:, mass.shape[1]:])


@dataclass(slots=True)
class PendingSample:
    """A sample whose device work is launched; ``collect`` reads it back (and waits for it)."""

    token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor]
    raw: Optional[torch.Tensor]  # the logits, when some row asks for top_logprobs
    requests: list[HeldRequest]

    def collect(self) -> SamplerOutput:
        logprobs = None if self.logprobs is None else self.logprobs.tolist()
        alternatives = None if self.raw is None else top_logprobs(self.raw, self.requests)
        return SamplerOutput(self.token_ids.tolist(), logprobs, alternatives)


def sample(logits: torch.Tensor, requests: list[HeldRequest]) -> SamplerOutput:
    """logits: float32 [len(requests), vocab], one row per request in order; not modified."""
    return launch_sample(logits, requests).collect()


def launch_sample(logits: torch.Tensor, requests: list[HeldRequest]) -> PendingSample:
    """``sample`` up to its host reads: what the host does next overlaps the device's work."""
    raw = logits
    biased = any(r.sampling.logit_bias for r in requests)
    penalized = any(r.sampling.repetition_penalty != 1.0 or r.sampling.frequency_penalty != 0.0
                    or r.sampling.presence_penalty != 0.0 for r in requests)
    held_back = any(holds_back_stops(r) for r in requests)
    if biased or penalized or held_back:
        logits = logits.clone()  # the caller's logits, and the logprobs, stay the raw ones
    if held_back:
        apply_min_tokens(logits, requests)
    if biased:
        apply_logit_bias(logits, requests)
    if penalized:
        apply_penalties(logits, requests)
    temperatures = [r.sampling.temperature for r in requests]
    token_ids = argmax_rows(logits)
    random_rows = [i for i, t in enumerate(temperatures) if t > GREEDY_TEMPERATURE]
    if random_rows:
        device = logits.device
        chosen = [requests[i] for i in random_rows]
        rows = host_values_to_device(random_rows, torch.long, device)
        temps = host_values_to_device([temperatures[i] for i in random_rows], logits.dtype, device)[:, None]
        scaled = apply_min_p(logits.index_select(0, rows) / temps, [r.sampling.min_p for r in chosen])
        top_k = [r.sampling.top_k for r in chosen]
        top_p = [r.sampling.top_p for r in chosen]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):  # skips a sort of every row
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, 1)
        keys = host_values_to_device([noise_seed(r.seed, r.num_output_tokens) for r in chosen], torch.long, device)
        token_ids.index_copy_(0, rows, race_sample(probs, keys))
    logprobs = None
    if any(r.sampling.logprobs for r in requests):  # vLLM's default: of the raw logits
        logprobs = torch.log_softmax(raw, 1).gather(1, token_ids[:, None])[:, 0]
    wants_top = logprobs is not None and any(r.sampling.top_logprobs for r in requests)
    return PendingSample(token_ids, logprobs, raw if wants_top else None, requests)
