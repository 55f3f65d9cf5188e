"""What a request's sampling parameters do to its logits before a token is chosen.

vLLM's semantics, in vLLM v1's order: min_tokens (no stop token yet), logit_bias, then the
penalties (repetition over prompt and output tokens; frequency and presence over output tokens
only), then (for sampled rows) temperature and min_p. Greedy requests take the argmax after
bias and penalties, so greedy with a penalty equals transformers' greedy with the same
processor. Every function works on a batch of rows, touching only the rows whose request asked
for the control.
"""

from __future__ import annotations

from collections import Counter

import torch

from pagedserve.kernels.device_indices import host_values_to_device
from pagedserve.protocol.step_state import HeldRequest


def apply_logit_bias(logits: torch.Tensor, requests: list[HeldRequest]) -> None:
    """OpenAI's logit_bias: each named token's bias is added to its logit (in place)."""
    for row, req in enumerate(requests):
        bias = req.sampling.logit_bias
        if bias:
            ids = host_values_to_device(list(bias.keys()), torch.long, logits.device)
            values = host_values_to_device(list(bias.values()), logits.dtype, logits.device)
            logits[row].index_add_(0, ids, values)


def apply_penalties(logits: torch.Tensor, requests: list[HeldRequest]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that ask for them.

    Only the logits of tokens the context holds change, so only those are read and written: a
    [rows, vocab] count per penalty cost 78 ms a step at 32 rows of a 152k vocabulary on a CPU
    (a model's generation_config, Qwen2.5's repetition_penalty 1.05, asks on every request). Each
    entry takes the same float operations as the dense form, in the same order."""
    seen_rows, seen_ids, seen_penalty = [], [], []  # repetition: every distinct token of prompt and output
    out_rows, out_ids, out_counts, out_frequency, out_presence = [], [], [], [], []
    for row, r in enumerate(requests):
        s = r.sampling
        if s.repetition_penalty != 1.0:
            distinct = set(r.token_ids)
            seen_rows += [row] * len(distinct)
            seen_ids += distinct
            seen_penalty += [s.repetition_penalty] * len(distinct)
        if s.frequency_penalty != 0.0 or s.presence_penalty != 0.0:
            counts = Counter(r.token_ids[r.num_prompt_tokens:])
            out_rows += [row] * len(counts)
            out_ids += counts.keys()
            out_counts += counts.values()
            out_frequency += [s.frequency_penalty] * len(counts)
            out_presence += [s.presence_penalty] * len(counts)
    if min(seen_ids, default=0) < 0 or min(out_ids, default=0) < 0:
        raise ValueError("a penalty read a placeholder token: the step's tokens were not resolved")
    device, dtype = logits.device, logits.dtype
    if seen_ids:
        at = (host_values_to_device(seen_rows, torch.long, device), host_values_to_device(seen_ids, torch.long, device))
        penalty = host_values_to_device(seen_penalty, dtype, device)
        values = logits[at]
        logits[at] = torch.where(values > 0, values / penalty, values * penalty)
    if out_ids:
        at = (host_values_to_device(out_rows, torch.long, device), host_values_to_device(out_ids, torch.long, device))
        counts = host_values_to_device(out_counts, dtype, device)
        frequency = host_values_to_device(out_frequency, dtype, device)
        presence = host_values_to_device(out_presence, dtype, device)
        logits[at] = logits[at] - frequency * counts - presence


def holds_back_stops(r: HeldRequest) -> bool:
    """vLLM's min_tokens: the row's stop tokens may not be sampled yet."""
    return bool(r.min_tokens_stops) and r.num_output_tokens < r.sampling.min_tokens


def apply_min_tokens(logits: torch.Tensor, requests: list[HeldRequest]) -> None:
    """vLLM's min_tokens, in place: a row with fewer outputs than its min_tokens cannot sample a
    stop token (EOS unless ignore_eos, and stop_token_ids), so the output neither holds one nor
    ends early. A row where that would leave nothing (a grammar that allows only a stop token) is
    left as it was: the grammar wins."""
    rows = [row for row, r in enumerate(requests) if holds_back_stops(r)]
    at_rows = [row for row in rows for _ in requests[row].min_tokens_stops]
    ids = [token for row in rows for token in requests[row].min_tokens_stops]
    at = (host_values_to_device(at_rows, torch.long, logits.device), host_values_to_device(ids, torch.long, logits.device))
    before = logits[at]
    logits[at] = -torch.inf
    # no host read of the result (on CUDA it would wait for the forward): every row is put back as
    # a where(), a no-op for a row with a token left
    which = host_values_to_device(rows, torch.long, logits.device)
    dead = torch.isneginf(logits.index_select(0, which).amax(1))
    counts = host_values_to_device([len(requests[row].min_tokens_stops) for row in rows], torch.long, logits.device)
    logits[at] = torch.where(dead.repeat_interleave(counts, output_size=len(ids)), before, logits[at])


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
