"""Embedding requests on the worker's side: each step's part of their pooled hidden state.

The hidden states are the model's after its final norm (transformers' ``last_hidden_state``).
A pooling request's chunk sends the sum of its rows (``mean``), or its last prompt token's row
in the step that computes it (``last``); the scheduler adds the chunks up and divides
(scheduler_proc/pooling.py), so no state is kept here and a swap or a restart loses nothing.
Only the rows of pooling requests pass through the final norm; nobody samples them.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedserve.protocol.messages import PooledChunk
from pagedserve.protocol.step_state import HeldRequest


def pool_chunks(hidden: torch.Tensor, requests: list[HeldRequest],
                final_norm: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, PooledChunk]:
    """By request id, what this step adds to each pooling request's embedding; ``requests`` are
    the step's entries in batch order from the first (their rows lead ``hidden``)."""
    pooled: dict[str, PooledChunk] = {}
    row = 0
    for req in requests:
        count = req.num_scheduled_tokens
        if req.pooling is not None:
            start = req.num_computed_tokens
            end = start + count
            if req.pooling == "mean":
                rows, first = hidden[row:row + count], start
            elif end == req.num_prompt_tokens:
                rows, first = hidden[row + count - 1:row + count], end - 1
            else:
                rows = None  # last-token pooling: an earlier chunk adds nothing
            if rows is not None:
                total = final_norm(rows).float().sum(0)
                pooled[req.req_id] = PooledChunk(first, rows.shape[0], total.cpu().numpy().astype("<f4").tobytes())
        row += count
    return pooled
