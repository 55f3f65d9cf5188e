"""vLLM's prompt_logprobs: the logprob of each prompt token under the distribution the model
gives at the position before it, with its rank and the request's k best alternatives.

Only requests that ask for them pay: their prompt rows of this step's chunk go through the
LM head (in slices, so a long chunk never holds a [chunk, vocab] logits tensor at once);
every other request still reaches it with its one sampled row only. Positions are taken
where the chunk computes them, so chunked prefill sends each chunk's positions as it runs;
the scheduler concatenates them and drops what a recomputed chunk sends again.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedserve.protocol.messages import PromptLogprobs
from pagedserve.protocol.step_state import HeldRequest

ROWS_PER_SLICE = 256  # logits rows materialized at once (x vocab x 4 bytes)


def prompt_positions(requests: list[HeldRequest], drafts=None) -> list[tuple[HeldRequest, int, int, int]]:
    """(request, first hidden row, first position, number of positions) for each request of the
    step (in batch order) that wants prompt logprobs and computes positions before its last
    prompt token here. Position ``p``'s logits score prompt token ``p + 1``. ``drafts``: the step's
    speculative proposals by request id, rows of their own after their request's."""
    wanted = []
    row = 0
    for req in requests:
        start = req.num_computed_tokens
        if req.sampling.prompt_logprobs is not None:
            stop = min(start + req.num_scheduled_tokens, req.num_prompt_tokens - 1)
            if stop > start:
                wanted.append((req, row, start, stop - start))
        row += req.num_scheduled_tokens + (len(drafts.get(req.req_id, ())) if drafts else 0)
    return wanted


def compute_prompt_logprobs(hidden: torch.Tensor, requests: list[HeldRequest],
                            compute_logits: Callable[[torch.Tensor], torch.Tensor], drafts=None) -> dict[str, PromptLogprobs]:
    """By request id, the prompt logprobs of this step's chunk (empty: nobody asked)."""
    results: dict[str, PromptLogprobs] = {}
    for req, first_row, start, count in prompt_positions(requests, drafts):
        k = req.sampling.prompt_logprobs
        targets = torch.tensor(req.token_ids[start + 1:start + 1 + count], device=hidden.device)
        logprobs: list[float] = []
        ranks: list[int] = []
        alternatives: list[list[tuple[int, float]]] = []
        for offset in range(0, count, ROWS_PER_SLICE):
            rows = slice(first_row + offset, first_row + min(offset + ROWS_PER_SLICE, count))
            log_probs = torch.log_softmax(compute_logits(hidden[rows]), dim=-1)
            chosen = targets[offset:offset + ROWS_PER_SLICE, None]
            picked = log_probs.gather(-1, chosen)
            logprobs += picked.squeeze(-1).tolist()
            ranks += ((log_probs > picked).sum(-1) + 1).tolist()
            if k > 0:
                values, ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
                alternatives += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                alternatives += [[] for _ in range(picked.shape[0])]
        results[req.req_id] = PromptLogprobs(start + 1, logprobs, ranks, alternatives)
    return results
