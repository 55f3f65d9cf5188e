"""The output side of a step, as decisions: the tokens each sample keeps, the stop rules, the parents to fork.

Stop rules, per sequence: a token in the request's eos ids (unless ``ignore_eos``) or in
``stop_token_ids`` ends it with "stop", but only once it has at least ``min_tokens``
outputs (before that the sampler masks them, as vLLM's min_tokens does: only a grammar that
allows nothing else gets one through); the stop token is part of ``new_token_ids`` and named in
``stop_token_id``.
Reaching ``max_tokens`` outputs, ``max_model_len`` tokens or the whole cache ends it
with "length".

These functions change no sequence's tokens, counters or blocks: what each keeps, what ends and
what forks they return, and the scheduler applies it (a grammar's matcher advances here). The
steady decodes' tokens are screened in running.py with array operations, then asked ``finish_of``.
"""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.messages import RequestDelta, SchedulerOutput, StepResult

from pagedserve.scheduler_proc import pooling
from pagedserve.scheduler_proc import prompt_logprobs as prompt_lp
from pagedserve.scheduler_proc.grammar import grammar_finish
from pagedserve.scheduler_proc.request import RUNNING, Sequence, child_sampling, token_array


class _NoLogprobs:
    """Stands in for an absent logprobs list: None at every index, of any length."""

    def __iter__(self):
        while True:
            yield None


_NO_LOGPROBS = _NoLogprobs()


class StepResultMismatch(ValueError):
    """A StepResult that does not answer the SchedulerOutput it is paired with."""


class Sampled:
    """What the per-object samples of one step decided, for the scheduler to apply."""

    __slots__ = ("deltas", "orders", "ended", "num_accepted", "appended")

    def __init__(self) -> None:
        self.deltas: list[RequestDelta] = []
        self.orders: list[int] = []  # of the sequences behind ``deltas``: a step's deltas go out in arrival order
        self.ended: list[Sequence] = []  # to retire, in this order
        self.num_accepted = 0
        # (sequence, tokens it keeps, proposals its verification rejected or None: it verified none)
        self.appended: list[tuple[Sequence, list[int], Optional[int]]] = []


def finish_of(seq: Sequence, token: int, length: int) -> Optional[str]:
    """The stop rules (above) for ``seq`` once it holds ``length`` tokens, ``token`` the last:
    "stop", "length" or None. The one implementation: the steady decodes' array test (running.py)
    only picks the sequences to ask."""
    if token in seq.stop_token_ids and length >= seq.min_len:
        return "stop"
    return "length" if length >= seq.max_len else None


def check_result(out: SchedulerOutput, result: StepResult, num_per_object: int) -> None:
    """Whether ``result`` answers ``out``: its step, its counts, the steady decodes' ids in order."""
    if result.step != out.step:
        raise StepResultMismatch(f"result for step {result.step} paired with step {out.step}")
    req_ids, tokens = result.req_ids, result.sampled_token_ids
    steady_ids = out.decodes.req_ids
    expected = num_per_object + len(steady_ids)
    if len(req_ids) != expected or len(tokens) != expected:
        raise StepResultMismatch(
            f"step {out.step} scheduled {expected} sampling sequences, the result has "
            f"{len(req_ids)} ids and {len(tokens)} tokens")
    if steady_ids and req_ids[num_per_object:] != steady_ids:
        index = next(i for i, (a, b) in enumerate(zip(req_ids[num_per_object:], steady_ids)) if a != b)
        raise StepResultMismatch(f"step {out.step}: a sample for {req_ids[num_per_object + index]!r} where "
                                 f"{steady_ids[index]!r} was due")
    for name in ("logprobs", "top_logprobs"):
        values = getattr(result, name)
        if values is not None and len(values) != len(tokens):
            raise StepResultMismatch(f"step {out.step}: {len(values)} {name} for {len(tokens)} tokens")


def read_samples(out: SchedulerOutput, result: StepResult, sampling_seqs: list[Sequence], others: list[Sequence],
                 speculator=None) -> Sampled:
    """Each per-object sequence's sample (checked by ``check_result``) under the stop rules, as
    decisions the scheduler applies (``Scheduler._apply_samples``): the tokens it keeps, the
    proposals it rejected, whether it ends, its delta. Only a grammar's matcher and the
    speculator's own counters move here.

    A sequence that verified proposals (speculation.py) gets its accepted ones, then the sample,
    each checked in turn: nothing past a stop or ``max_tokens`` is kept or sent."""
    if result.prompt_logprobs:
        try:
            prompt_lp.merge(out.step, result.prompt_logprobs, {s.seq_id: s for s in (*sampling_seqs, *others)})
        except prompt_lp.PromptLogprobsMismatch as exc:
            raise StepResultMismatch(str(exc)) from None
    if speculator is not None:  # what the step's forward took prices a proposal (spec_cost.py)
        speculator.cost.note_forward(out.step, result.forward_time_s)
    sampled = Sampled()
    append, ended, appended = sampled.deltas.append, sampled.ended, sampled.appended.append
    orders = sampled.orders
    if others or result.pooled:  # embedding requests end with their prompt's last chunk (pooling.py)
        try:
            pooling.apply_pooled(out, result.pooled, others, sampled.deltas, orders, ended)
        except pooling.PooledMismatch as exc:
            raise StepResultMismatch(str(exc)) from None
    logprobs = _NO_LOGPROBS if result.logprobs is None else result.logprobs
    alternatives = _NO_LOGPROBS if result.top_logprobs is None else result.top_logprobs
    tokens = result.sampled_token_ids[:len(sampling_seqs)]
    for seq, req_id, token, logprob, top in zip(sampling_seqs, result.req_ids, tokens, logprobs, alternatives):
        if seq.seq_id != req_id:
            raise StepResultMismatch(f"step {out.step}: a sample for {req_id!r} where {seq.seq_id!r} was due")
        if seq.status != RUNNING:
            continue  # aborted while the step ran
        new_tokens, rejected = [token], None
        if seq.spec is not None and seq.spec.drafts:
            new_tokens, rejected = accepted_tokens(out, result, seq, token, speculator)
        length = len(seq.token_ids)
        finish = stop_token = None
        for i, token in enumerate(new_tokens):
            if (finish := finish_of(seq, token, length + i + 1)) is not None:
                stop_token = token if finish == "stop" else None
                del new_tokens[i + 1:]
                break
        length += len(new_tokens)
        sampled.num_accepted += len(new_tokens)
        appended((seq, new_tokens, rejected))
        if speculator is not None and seq.spec is not None and speculator.from_worker:
            speculator.receive(seq, result.draft_token_ids.get(seq.seq_id), length)
        error = error_kind = None
        if finish is None and seq.grammar is not None:
            finish, stop_token, error, error_kind = grammar_finish(seq, token)
        orders.append(seq.order)
        prompt = None
        if seq.sampling.prompt_logprobs is not None and length == seq.num_prompt_tokens + 1:
            try:  # each sample's first token carries them
                prompt = prompt_lp.complete(seq.request)
            except prompt_lp.PromptLogprobsMismatch as exc:
                raise StepResultMismatch(f"step {out.step}: {exc}") from None
        append(RequestDelta(seq.request_id, seq.index, new_tokens, finish, error, error_kind, seq.num_prompt_tokens,
                            seq.num_cached_tokens, [logprob] if seq.want_logprobs and logprob is not None else None,
                            stop_token, [top] if seq.want_logprobs and top else None, prompt))
        if finish is not None:
            ended.append(seq)
    return sampled


def accepted_tokens(out: SchedulerOutput, result: StepResult, seq: Sequence, token: int,
                    speculator) -> tuple[list[int], int]:
    """``seq``'s accepted proposals then ``token``, and how many proposals were rejected."""
    drafts = seq.spec.drafts
    num_accepted = result.num_accepted_tokens.get(seq.seq_id)
    if num_accepted is None or not 0 <= num_accepted <= len(drafts):
        raise StepResultMismatch(f"step {out.step}: {seq.seq_id!r} verified {len(drafts)} proposals but the "
                                 f"result accepts {num_accepted}")
    accepted = drafts[:num_accepted]
    speculator.settle(seq, num_accepted)
    return [*accepted, token], len(drafts) - num_accepted


def in_arrival_order(deltas: list[RequestDelta], orders: list[int]) -> list[RequestDelta]:
    """A step's deltas sorted by their sequences' arrival (per-object samples and steady ends interleave)."""
    return [delta for _, delta in sorted(zip(orders, deltas), key=_first)]


def parents_to_fork(others: list[Sequence]) -> list[Sequence]:
    """After a step: the parents among the running non-sampling sequences that computed prompt[:-1]."""
    return [seq for seq in others if seq.is_parent and seq.num_kv_tokens == len(seq.token_ids) - 1]


def _first(pair):
    return pair[0]


def children_of(parent: Sequence) -> list[Sequence]:
    """The n running children of a parent that computed prompt[:-1]; its blocks are shared by the block manager."""
    request = parent.request
    children = []
    for i in range(request.sampling.n):
        child = Sequence(f"{request.request_id}/{i}", request, i, token_array(parent.token_ids),
                         child_sampling(request, i), False)
        child.num_kv_tokens = parent.num_kv_tokens
        child.block_keys = list(parent.block_keys)
        child.recompute_until = parent.recompute_until
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RUNNING
        children.append(child)
    return children
