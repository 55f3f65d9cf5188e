"""The step contract's receiving half: how one SchedulerOutput changes the per-request state
every reader of the protocol keeps (the worker's model runner, ``pagedserve trace show``, the
tests' simulated worker). Pure Python on plain lists: no torch, no sockets.

``apply_output`` forgets finished requests, registers new ones, applies cached requests'
diffs and the decodes, and returns the step's entries in batch order with their
``num_computed_tokens`` (before this step), ``num_scheduled_tokens`` and ``samples`` set.
Cache operations (swap, copy, zero) are the caller's: they touch memory only it has.

A decode token may be ``PLACEHOLDER_TOKEN``: the scheduler sent this step before the
previous one's result reached it (overlapped scheduling), so the receiver substitutes the
token it sampled for that request last (``last_sampled``, which the sampler's caller sets).

A hybrid model's step (``GroupedSchedulerOutput``, protocol/kv_groups.py) also grows each request's
local tables (``window_tables``), which stay as long as its global table ``block_ids``.
"""

from __future__ import annotations

from typing import Optional

from pagedserve.protocol.messages import GroupedSchedulerOutput, SamplingParams, SchedulerOutput

PLACEHOLDER_TOKEN = -1  # never a real token id: the vocabulary starts at 0


class StepContractError(ValueError):
    """A SchedulerOutput that does not fit the state its receiver holds; the message says where."""


class HeldRequest:
    """One request as a receiver of SchedulerOutputs holds it between steps."""

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens",
                 "num_scheduled_tokens", "samples", "sampling", "seed", "last_sampled", "pooling", "min_tokens_stops",
                 "lora_slot", "window_tables")

    def __init__(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, block_ids: list[int],
                 num_computed_tokens: int, num_scheduled_tokens: int, sampling: SamplingParams,
                 seed: Optional[int] = None, samples: bool = True, pooling: Optional[str] = None,
                 min_tokens_stops: tuple[int, ...] = ()):
        self.req_id = req_id
        self.token_ids = token_ids  # prompt, then every output token (placeholders resolved)
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens  # before this step
        self.num_scheduled_tokens = num_scheduled_tokens  # this step
        self.samples = samples  # this step ends with a sample
        self.sampling = sampling
        self.seed = sampling.seed if seed is None else seed
        self.last_sampled: Optional[int] = None  # the token sampled in this request's latest step
        self.pooling = pooling  # an embedding request: "last" | "mean" (protocol/pooling.py); never samples
        self.min_tokens_stops = min_tokens_stops  # masked before sampling.min_tokens outputs (logits_processors.py)
        self.lora_slot = -1  # the worker's LoRA slot that computes it (LoRAStep.request_slots); -1: the base model
        self.window_tables: list[list[int]] = []  # a hybrid model's local groups' block tables

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"HeldRequest({self.req_id!r}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
                f"scheduled={self.num_scheduled_tokens}, samples={self.samples}, blocks={self.block_ids})")


def apply_output(held: dict[str, HeldRequest], out: SchedulerOutput,
                 resolve_placeholders: bool = True) -> list[HeldRequest]:
    """Apply ``out`` to ``held`` (by request id); returns the step's entries in batch order.

    ``resolve_placeholders=False`` keeps placeholders as they are, for a reader that counts
    tokens but never sees the samples in time (a trace read in order, where a step sent ahead
    precedes the result it depends on). An error leaves earlier entries applied: a worker
    that gets one is restarted, so nothing runs on that state again.
    """
    step = out.step
    for req_id in out.finished_req_ids:
        held.pop(req_id, None)
    scheduled = []
    append = scheduled.append
    for new in out.new_requests:
        if new.req_id in held:
            raise StepContractError(f"step {step}: new request {new.req_id!r} is already held")
        state = HeldRequest(new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                            new.num_computed_tokens, new.num_scheduled_tokens, new.sampling, samples=new.samples,
                            pooling=new.pooling, min_tokens_stops=tuple(new.min_tokens_stop_ids))
        held[new.req_id] = state
        append(state)
    for diff in out.cached_requests:
        state = held.get(diff.req_id)
        if state is None:
            raise StepContractError(f"step {step}: cached request {diff.req_id!r} is unknown here "
                                    f"(never sent as new, or already finished)")
        done = state.num_computed_tokens + state.num_scheduled_tokens
        if diff.num_computed_tokens != done:
            raise StepContractError(f"step {step}: cached request {diff.req_id!r} continues from token "
                                    f"{diff.num_computed_tokens} but {done} are computed here (out of sync)")
        state.token_ids += diff.new_token_ids
        state.block_ids += diff.new_block_ids
        state.num_computed_tokens = diff.num_computed_tokens
        state.num_scheduled_tokens = diff.num_scheduled_tokens
        state.samples = diff.samples
        append(state)
    _apply_decodes(held, out, scheduled, resolve_placeholders)
    if isinstance(out, GroupedSchedulerOutput):
        _apply_window_blocks(held, out, scheduled)
    for state in scheduled:
        end = state.num_computed_tokens + state.num_scheduled_tokens
        if end > len(state.token_ids) or (state.samples and (end != len(state.token_ids)
                                                              or state.num_scheduled_tokens < 1
                                                              or state.pooling is not None)):
            raise StepContractError(
                f"step {step}: request {state.req_id!r} computes [{state.num_computed_tokens}, {end}) "
                f"{'and samples ' if state.samples else ''}but {len(state.token_ids)} tokens are known")
    return scheduled


def _apply_decodes(held: dict[str, HeldRequest], out: SchedulerOutput, scheduled: list[HeldRequest],
                   resolve_placeholders: bool) -> None:
    # Runs for every running request every step: no per-request allocation beyond the dict get.
    decodes, step = out.decodes, out.step
    req_ids = decodes.req_ids
    num_decodes = len(req_ids)
    if len(decodes.num_computed_tokens) != num_decodes or len(decodes.token_ids) != num_decodes:
        raise StepContractError(f"step {step}: decodes: {num_decodes} req_ids but {len(decodes.num_computed_tokens)} "
                                f"num_computed_tokens and {len(decodes.token_ids)} token_ids")
    first = len(scheduled)
    append = scheduled.append
    for req_id, position, token in zip(req_ids, decodes.num_computed_tokens, decodes.token_ids):
        state = held.get(req_id)
        if state is None:
            raise StepContractError(f"step {step}: decode request {req_id!r} is unknown here "
                                    f"(never sent as new, or already finished)")
        token_ids = state.token_ids
        # The new token goes at ``position``: anything else means this receiver
        # missed (or double-applied) a step and its KV no longer matches the scheduler's.
        if position != len(token_ids):
            raise StepContractError(f"step {step}: decode request {req_id!r}: its new token is at position "
                                    f"{position} but {len(token_ids)} tokens are held here (out of sync)")
        if token == PLACEHOLDER_TOKEN and resolve_placeholders:
            token = placeholder_token(state, step)
        token_ids.append(token)
        state.num_computed_tokens = position
        state.num_scheduled_tokens = 1
        state.samples = True
        append(state)
    for index, block in decodes.new_blocks:
        if not 0 <= index < num_decodes:  # a negative index would silently pick another request
            raise StepContractError(f"step {step}: decodes: new block {block} names decode {index}, "
                                    f"but the step has {num_decodes} decodes")
        scheduled[first + index].block_ids.append(block)


def _apply_window_blocks(held: dict[str, HeldRequest], out: GroupedSchedulerOutput,
                        scheduled: list[HeldRequest]) -> None:
    """Each request's local tables grow by the step's blocks, to the global table's length."""
    step = out.step
    for req_id, blocks in out.window_block_ids.items():
        state = held.get(req_id)
        if state is None:
            raise StepContractError(f"step {step}: local blocks for {req_id!r}, which is not held here")
        if not state.window_tables:
            state.window_tables = [[] for _ in blocks]
        if len(blocks) != len(state.window_tables):
            raise StepContractError(f"step {step}: {req_id!r}: blocks for {len(blocks)} local tables, "
                                    f"{len(state.window_tables)} held")
        for table, new in zip(state.window_tables, blocks):
            table += new
    for state in scheduled:
        if not state.window_tables or any(len(t) != len(state.block_ids) for t in state.window_tables):
            raise StepContractError(f"step {step}: {state.req_id!r}: local tables of "
                                    f"{[len(t) for t in state.window_tables]} blocks, its global one "
                                    f"{len(state.block_ids)}")


def placeholder_token(state: HeldRequest, step: int) -> int:
    """The token a placeholder of ``state`` in step ``step`` stands for: its newest sample."""
    if state.last_sampled is None:
        raise StepContractError(f"step {step}: decode request {state.req_id!r} asks for the token sampled "
                                f"last step, but none was sampled for it here")
    return state.last_sampled


def note_samples(sampled: list[HeldRequest], token_ids: list[int]) -> None:
    """Remember each request's newest sample: a later decode may send a placeholder for it."""
    for state, token in zip(sampled, token_ids):
        state.last_sampled = token


def note_accepted(held: dict[str, HeldRequest], num_accepted: dict[str, int], block_size: Optional[int]) -> None:
    """Speculative decoding: each request's computed tokens grow by its accepted proposals
    (``StepResult.num_accepted_tokens``), which the next step sends as new tokens, and its block
    table drops the blocks past them, which the scheduler gave back (None: a reader that keeps
    no block tables)."""
    for req_id, count in num_accepted.items():
        state = held.get(req_id)
        if state is not None:
            state.num_scheduled_tokens += count
            if block_size is not None:
                keep = -(-(state.num_computed_tokens + state.num_scheduled_tokens) // block_size)
                for table in (state.block_ids, *state.window_tables):
                    del table[keep:]
