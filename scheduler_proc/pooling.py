"""Embedding requests on the scheduler's side: the workers' pooled chunks, joined per request.

A pooling request runs as a prompt that never samples (step.py sends its last chunk with
``samples`` false), so it never decodes. Each step's result carries, per pooling request, the
sum of the hidden states its chunk computed (protocol/pooling.py); they are added here in
prompt order, in float64. A chunk from position 0 starts the sum over: the request was
recompute-preempted and computes its prompt again (mean pooling never takes prefix-cache hits,
admission.py). A swapped-out request keeps its sum, which is why the sums live here and not in
the workers. Once the last prompt position is in, the request ends with one delta carrying the
embedding (the mean, or the last token's state), and the scheduler frees its blocks at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from pagedserve.protocol.messages import PooledChunk, RequestDelta, SchedulerOutput

from pagedserve.scheduler_proc.request import RUNNING

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.request import Request, Sequence


class PooledMismatch(ValueError):
    """Pooled chunks in a step result that do not fit what the step computed."""


class PooledSum:
    """One request's sum so far: positions ``[0, until)``."""

    __slots__ = ("until", "total")

    def __init__(self, chunk: PooledChunk):
        self.until = chunk.end
        self.total = np.frombuffer(chunk.values, "<f4").astype(np.float64)


def apply_pooled(out: SchedulerOutput, chunks: Optional[dict[str, PooledChunk]], others: list["Sequence"],
                 deltas: list[RequestDelta], orders: list[int], ended: list["Sequence"]) -> None:
    """Add each chunk to its request's sum; a request whose prompt is all in ends (its delta
    appended to ``deltas``, its order to ``orders``, itself to ``ended``)."""
    chunks = chunks or {}
    pooling = {seq.seq_id: seq for seq in others if seq.request.pooling is not None}
    for seq_id in chunks:
        if seq_id not in pooling:
            raise PooledMismatch(f"step {out.step}: a pooled chunk for {seq_id!r}, which pools nothing this step")
    if not pooling:
        return
    for entry in (*out.new_requests, *out.cached_requests):
        seq = pooling.get(entry.req_id)
        if seq is None:
            continue
        request = seq.request
        end = entry.num_computed_tokens + entry.num_scheduled_tokens
        chunk = chunks.get(entry.req_id)
        if chunk is not None:
            _add(out.step, request, chunk, end)
        if end < request.num_prompt_tokens or seq.status != RUNNING:
            continue  # more to compute, or aborted while the step ran
        if request.pooled is None or request.pooled.until != end:
            raise PooledMismatch(f"step {out.step}: {entry.req_id!r} computed its last prompt token but its pooled "
                                 f"positions end at {0 if request.pooled is None else request.pooled.until}")
        deltas.append(RequestDelta(seq.request_id, seq.index, [], "stop", None, None, seq.num_prompt_tokens,
                                   seq.num_cached_tokens, embedding=embedding_of(request)))
        orders.append(seq.order)
        ended.append(seq)


def _add(step: int, request: "Request", chunk: PooledChunk, end: int) -> None:
    seq_id = request.request_id
    if chunk.end != end:
        raise PooledMismatch(f"step {step}: {seq_id!r} pooled positions [{chunk.start}, {chunk.end}) in a step "
                             f"that computed up to {end}")
    if request.pooling == "last" and (chunk.count != 1 or chunk.end != request.num_prompt_tokens):
        raise PooledMismatch(f"step {step}: {seq_id!r} pools its last token but got positions "
                             f"[{chunk.start}, {chunk.end}) of {request.num_prompt_tokens}")
    held = request.pooled
    if chunk.start == 0 or request.pooling == "last":
        request.pooled = PooledSum(chunk)
        return
    if held is None or held.until != chunk.start:
        raise PooledMismatch(f"step {step}: {seq_id!r} pooled positions from {chunk.start}, but those before "
                             f"it end at {0 if held is None else held.until}")
    values = np.frombuffer(chunk.values, "<f4")
    if values.shape != held.total.shape:
        raise PooledMismatch(f"step {step}: {seq_id!r} pooled {values.size} values after {held.total.size}")
    held.total += values
    held.until = chunk.end


def embedding_of(request: "Request") -> bytes:
    """The request's pooled vector (not normalised: the client normalises after any truncation)."""
    total = request.pooled.total
    if request.pooling == "mean":
        total = total / request.num_prompt_tokens
    return total.astype("<f4").tobytes()
