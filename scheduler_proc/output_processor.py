"""The output side of a step: append sampled tokens, stop sequences, fork parents.

Stop rules, per sequence: a token in the request's eos ids (unless ``ignore_eos``) or in
``stop_token_ids`` ends it with "stop", but only once it has at least ``min_tokens``
outputs; the stop token is part of ``new_token_ids`` and named in ``stop_token_id``.
Reaching ``max_tokens`` outputs, ``max_model_len`` tokens or the whole cache ends it
with "length".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.protocol.messages import RequestDelta, SchedulerOutput, StepResult

from pagedserve.scheduler_proc import prefix_cache
from pagedserve.scheduler_proc.request import FINISHED, RUNNING, Sequence, token_array

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.scheduler import Scheduler


class _NoLogprobs:
    """Stands in for an absent logprobs list: None at every index, of any length."""

    def __iter__(self):
        while True:
            yield None


_NO_LOGPROBS = _NoLogprobs()


class StepResultMismatch(ValueError):
    """A StepResult that does not answer the SchedulerOutput it is paired with."""


def process(sched: "Scheduler", out: SchedulerOutput, result: StepResult) -> list[RequestDelta]:
    flight = sched.in_flight
    if flight is None or flight[0] is not out:
        # An empty step (nothing computed), or a step that fail_all() already wrote off.
        return []
    if result.step != out.step:
        raise StepResultMismatch(f"result for step {result.step} paired with step {out.step}")
    sampling_seqs, others = flight[1], flight[2]
    req_ids, tokens = result.req_ids, result.sampled_token_ids
    if len(req_ids) != len(sampling_seqs) or len(tokens) != len(sampling_seqs):
        raise StepResultMismatch(
            f"step {out.step} scheduled {len(sampling_seqs)} sampling sequences, the result has "
            f"{len(req_ids)} ids and {len(tokens)} tokens")
    sched.in_flight = None
    logprobs = result.logprobs
    prefix = sched.config.enable_prefix_caching
    block_size = sched.block_size
    device = sched.bm.device
    deltas = []
    append = deltas.append
    accepted = 0
    if logprobs is None:
        logprobs = _NO_LOGPROBS
    elif len(logprobs) != len(tokens):
        raise StepResultMismatch(f"step {out.step}: {len(logprobs)} logprobs for {len(tokens)} tokens")
    for seq, req_id, token, logprob in zip(sampling_seqs, req_ids, tokens, logprobs):
        if seq.seq_id != req_id:
            raise StepResultMismatch(f"step {out.step}: a sample for {req_id!r} where {seq.seq_id!r} was due")
        if seq.status != RUNNING:
            continue  # aborted while the step ran
        if prefix and seq.num_computed // block_size > len(seq.block_keys):
            prefix_cache.register_computed(device, seq, block_size)
        seq_tokens = seq.token_ids
        seq_tokens.append(token)
        accepted += 1
        finish = stop_token = None
        if token in seq.stop_token_ids and len(seq_tokens) >= seq.min_len:
            finish = "stop"
            stop_token = token
        elif len(seq_tokens) >= seq.max_len:
            finish = "length"
        append(RequestDelta(seq.request_id, seq.index, [token], finish, None, None, seq.num_prompt_tokens,
                            seq.num_cached_tokens, [logprob] if seq.want_logprobs and logprob is not None else None,
                            stop_token))
        if finish is not None:
            _finish(sched, seq)
    sched.counters.generation_tokens += accepted
    for seq in others:
        if seq.status != RUNNING:
            continue
        if prefix:
            prefix_cache.register_computed(device, seq, block_size)
        if seq.is_parent and seq.num_computed == len(seq.token_ids) - 1:
            fork(sched, seq)
    return deltas


def _finish(sched: "Scheduler", seq: Sequence) -> None:
    sched.bm.free(seq)
    seq.status = FINISHED
    sched.num_gone_running += 1
    if seq.worker_knows:
        sched.finished_ids.append(seq.seq_id)
        seq.worker_knows = False
    request = seq.request
    request.unfinished_indices.discard(seq.index)
    if not request.unfinished_indices:
        del sched.requests[request.request_id]
        request.sequences = []  # break the request <-> sequence cycle: freed without the collector
        sched.counters.num_finished += 1


def fork(sched: "Scheduler", parent: Sequence) -> list[Sequence]:
    """Replace a running parent that computed prompt[:-1] by its n children, sharing its blocks."""
    request = parent.request
    n = request.sampling.n
    children = []
    for i in range(n):
        child = Sequence(f"{request.request_id}/{i}", request, i, token_array(parent.token_ids),
                         sched.child_sampling(request, i), False)
        child.num_computed = parent.num_computed
        child.block_keys = list(parent.block_keys)
        child.recompute_until = parent.recompute_until
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RUNNING
        children.append(child)
    sched.bm.fork(parent, children)
    running = sched.running
    position = running.index(parent)
    running[position:position + 1] = children
    sched.parent_seats -= n - 1
    parent.status = FINISHED
    if parent.worker_knows:
        sched.finished_ids.append(parent.seq_id)
        parent.worker_knows = False
    request.sequences = children
    return children
