"""The output side of a step: append sampled tokens, stop sequences, fork parents.

Stop rules, per sequence: a token in the request's eos ids (unless ``ignore_eos``) or in
``stop_token_ids`` ends it with "stop", but only once it has at least ``min_tokens``
outputs; the stop token is part of ``new_token_ids`` and named in ``stop_token_id``.
Reaching ``max_tokens`` outputs, ``max_model_len`` tokens or the whole cache ends it
with "length".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedserve.protocol.messages import RequestDelta, SchedulerOutput, StepResult

from pagedserve.scheduler_proc import prefix_cache
from pagedserve.scheduler_proc import prompt_logprobs as prompt_lp
from pagedserve.scheduler_proc.decode_lane import lane_ready
from pagedserve.scheduler_proc.grammar import grammar_finish
from pagedserve.scheduler_proc.request import FINISHED, RUNNING, Sequence, child_sampling, token_array
from pagedserve.scheduler_proc.step import StepOutputs

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


def process(sched: "Scheduler", out: SchedulerOutput, result: StepResult) -> StepOutputs:
    flight = sched.in_flight[0] if sched.in_flight else None
    if flight is None or flight[0] is not out:
        # An empty step (nothing computed), or a step that fail_all() already wrote off.
        return StepOutputs([])
    if result.step != out.step:
        raise StepResultMismatch(f"result for step {result.step} paired with step {out.step}")
    sampling_seqs, others = flight[1], flight[2]
    req_ids, tokens = result.req_ids, result.sampled_token_ids
    num_slow = len(sampling_seqs)
    lane_ids = out.decodes.req_ids
    expected = num_slow + len(lane_ids)
    if len(req_ids) != expected or len(tokens) != expected:
        raise StepResultMismatch(
            f"step {out.step} scheduled {expected} sampling sequences, the result has "
            f"{len(req_ids)} ids and {len(tokens)} tokens")
    if lane_ids and req_ids[num_slow:] != lane_ids:
        index = next(i for i, (a, b) in enumerate(zip(req_ids[num_slow:], lane_ids)) if a != b)
        raise StepResultMismatch(f"step {out.step}: a sample for {req_ids[num_slow + index]!r} where "
                                 f"{lane_ids[index]!r} was due")
    sched.in_flight.pop(0)
    if result.prompt_logprobs:
        try:
            prompt_lp.merge(out.step, result.prompt_logprobs, {s.seq_id: s for s in (*sampling_seqs, *others)})
        except prompt_lp.PromptLogprobsMismatch as exc:
            raise StepResultMismatch(str(exc)) from None
    logprobs = result.logprobs
    prefix = sched.config.enable_prefix_caching
    block_size = sched.block_size
    device = sched.bm.device
    deltas = []
    append = deltas.append
    orders = []  # of the sequences behind ``deltas``: a step's deltas go out in arrival order
    accepted = 0
    alternatives = result.top_logprobs
    if logprobs is None:
        logprobs = _NO_LOGPROBS
    elif len(logprobs) != len(tokens):
        raise StepResultMismatch(f"step {out.step}: {len(logprobs)} logprobs for {len(tokens)} tokens")
    if alternatives is None:
        alternatives = _NO_LOGPROBS
    elif len(alternatives) != len(tokens):
        raise StepResultMismatch(f"step {out.step}: {len(alternatives)} top_logprobs for {len(tokens)} tokens")
    for seq, req_id, token, logprob, top in zip(sampling_seqs, req_ids, tokens[:num_slow], logprobs, alternatives):
        if seq.seq_id != req_id:
            raise StepResultMismatch(f"step {out.step}: a sample for {req_id!r} where {seq.seq_id!r} was due")
        if seq.status != RUNNING:
            continue  # aborted while the step ran
        if prefix and seq.num_kv_tokens // block_size > len(seq.block_keys):
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
        error = None
        if finish is None and seq.grammar is not None:
            finish, stop_token, error = grammar_finish(seq, token)
        orders.append(seq.order)
        prompt = None
        if seq.sampling.prompt_logprobs is not None and len(seq_tokens) == seq.num_prompt_tokens + 1:
            try:  # each sample's first token carries them
                prompt = prompt_lp.complete(seq.request)
            except prompt_lp.PromptLogprobsMismatch as exc:
                raise StepResultMismatch(f"step {out.step}: {exc}") from None
        append(RequestDelta(seq.request_id, seq.index, [token], finish, error, error and "engine", seq.num_prompt_tokens,
                            seq.num_cached_tokens, [logprob] if seq.want_logprobs and logprob is not None else None,
                            stop_token, [top] if seq.want_logprobs and top else None, prompt))
        if finish is not None:
            _finish(sched, seq)
    if lane_ids:
        num_slow_deltas = len(deltas)
        outputs = _apply_lane(sched, tokens[num_slow:] if num_slow else tokens, deltas, orders)
        if len(deltas) > max(num_slow_deltas, 1):  # the lane's ends come in lane order
            outputs.deltas = [delta for _, delta in sorted(zip(orders, deltas), key=_first)]
    else:
        outputs = StepOutputs(deltas)
    sched.counters.generation_tokens += accepted
    lane = sched.lane
    for seq in sampling_seqs:  # with a batch out, behind its positions (decode_lane.enter)
        if seq.status == RUNNING and seq.lane_pos < 0 and lane_ready(seq):
            lane.enter(seq)
            sched.num_gone_running += 1  # its entry in running is now stale
    for seq in others:
        if seq.status != RUNNING:
            continue
        if prefix:
            prefix_cache.register_computed(device, seq, block_size)
        if seq.is_parent and seq.num_kv_tokens == len(seq.token_ids) - 1:
            fork(sched, seq)
    return outputs


def _any_of(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.isin``, without its sort for the usual handful of stop ids."""
    if len(ids) > 8:
        return np.isin(values, ids)
    hit = values == ids[0]
    for token in ids[1:].tolist():
        hit |= values == token
    return hit


def _first(pair):
    return pair[0]


def _apply_lane(sched: "Scheduler", tokens: list[int], deltas: list[RequestDelta], orders: list[int]) -> StepOutputs:
    """The decode lane's tokens, checked for their ends with array operations.

    Only the exceptions touch a Sequence: a stop-token candidate, a sequence at its length
    limit, a block that just filled (published to the prefix cache). The tokens of sequences
    that ended or were aborted while the batch was out are already gone (``DecodeLane.record``).
    """
    lane = sched.lane
    where, values = lane.record(tokens)
    in_order = isinstance(where, slice)  # rows are positions 0..n-1
    if not in_order:
        tokens = values.tolist()
    ahead = len(lane.in_flight)  # 1 when the next step, scheduled ahead, is out too
    new_len = lane.computed[where] + 1 - ahead  # tokens each sequence holds now
    at_limit = new_len >= lane.max_len[where]
    stop_ids = lane.stop_ids()
    stop_candidate = _any_of(values, stop_ids) & (new_len >= lane.min_len[where]) if len(stop_ids) else None
    ends = at_limit if stop_candidate is None else at_limit | stop_candidate
    if sched.config.enable_prefix_caching:
        filled = (new_len - 1) % sched.block_size == 0
        lane.publish_filled((filled.nonzero()[0] if in_order else where[filled]).tolist(), sched.bm.device, ahead)
    m = len(tokens)
    sched.counters.generation_tokens += m
    gone = ends.nonzero()[0].tolist()
    if not gone:
        if in_order:  # sequences that entered while this batch was out sit behind its m positions
            lane.lists_out = True  # the frontend's lists share the lane's until it changes them
            request_ids = lane.request_ids if lane.n == m else lane.request_ids[:m]
            return StepOutputs(deltas, request_ids, lane.index[:m].tolist(), tokens)
        ids = lane.request_ids
        return StepOutputs(deltas, [ids[pos] for pos in where.tolist()], lane.index[where].tolist(), tokens)
    gone_positions = gone if in_order else where[gone].tolist()
    lane.sync_many(gone_positions)  # blocks to free
    keep = np.ones(m, bool)
    ended = []
    seqs = lane.seqs
    for row, pos in zip(gone, gone_positions):
        seq = seqs[pos]
        token = tokens[row]
        if stop_candidate is not None and stop_candidate[row] and token in seq.stop_token_ids:
            finish, stop_token = "stop", token
        elif at_limit[row]:
            finish, stop_token = "length", None
        else:
            continue  # another sequence's stop token
        keep[row] = False
        ended.append(pos)
        orders.append(seq.order)
        deltas.append(RequestDelta(seq.request_id, seq.index, [token], finish, None, None,
                                   seq.num_prompt_tokens, seq.num_cached_tokens, None, stop_token))
        _retire(sched, seq)
    ids = lane.request_ids
    kept = keep.nonzero()[0] if in_order else where[keep]
    outputs = StepOutputs(deltas, [ids[pos] for pos in kept.tolist()], lane.index[kept].tolist(), values[keep].tolist())
    lane.remove_many(ended)  # a batch out that holds them drops their next token (decode_lane.record)
    return outputs


def _finish(sched: "Scheduler", seq: Sequence) -> None:
    sched.num_gone_running += 1
    _retire(sched, seq)


def _retire(sched: "Scheduler", seq: Sequence) -> None:
    """``seq`` ended: its blocks back, the workers told, its request closed with its last sample."""
    sched.bm.free(seq)
    seq.status = FINISHED
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
                         child_sampling(request, i), False)
        child.num_kv_tokens = parent.num_kv_tokens
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
