"""Applies a step's grammar bitmask (SchedulerOutput.grammar) to the logits before sampling.

The scheduler fills one row of allowed tokens per constrained entry that samples; here each
row's disallowed tokens get -inf, so every later processor and the sampler only see tokens
the grammar allows (and logprobs are of that masked distribution, as in vLLM). Every rank
applies the same rows to the same logits, so every rank samples the same token.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedserve.kernels.device_indices import host_values_to_device, to_device_indices
from pagedserve.protocol.messages import GrammarBitmask
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.worker_proc.input_batch import BatchError

def unpack_bitmask(grammar: GrammarBitmask, vocab_size: int,
                   device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """[rows, vocab_size] bool on ``device``: True where the token is allowed. The packed words
    travel (a 32nd of the mask, without blocking on CUDA) and are unpacked there."""
    words = np.frombuffer(grammar.bitmask, dtype="<i4").reshape(len(grammar.req_ids), grammar.words_per_row)
    packed = to_device_indices(torch.from_numpy(words.astype(np.int32)), device)
    bits = (packed[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    allowed = bits.reshape(len(grammar.req_ids), grammar.words_per_row * 32)
    if allowed.shape[1] < vocab_size:  # rows narrower than the logits: the tokens past them are refused
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[HeldRequest], grammar: Optional[GrammarBitmask],
                          step: int) -> torch.Tensor:
    """``logits`` [len(requests), vocab] with each constrained row masked (a new tensor when any is)."""
    if grammar is None or not grammar.req_ids:
        return logits
    row_of = {req.req_id: row for row, req in enumerate(requests)}
    rows = []
    for req_id in grammar.req_ids:
        row = row_of.get(req_id)
        if row is None:
            raise BatchError(f"step {step}: the grammar bitmask names {req_id!r}, which does not "
                                    f"sample in this step")
        rows.append(row)
    allowed = unpack_bitmask(grammar, logits.shape[-1], logits.device)
    index = host_values_to_device(rows, torch.long, logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked
