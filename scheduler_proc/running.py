"""The running sequences: one interface over two representations.

Most running sequences are steady decodes, held as numpy columns in the decode lane
(decode_lane.py), which keeps the scheduler's cost per sequence flat in N (bench/log/2026-11-22.md,
"Scheduler"); the rest (prefills, parents, copy-on-write tails, logprobs, grammars) are
``Sequence`` objects in a list in arrival order. Only this module and the lane know that
there are two: the scheduler asks it for the newest sequence, a victim's removal, the
per-object ones to schedule and the steady decodes' batch, and nothing else reads the lane.

The scheduler owns this object and is the only caller of its mutating methods.
"""

from __future__ import annotations

from bisect import insort
from operator import attrgetter
from typing import TYPE_CHECKING, Optional

import numpy as np

from pagedserve.protocol.messages import DecodeBatch, RequestDelta

from pagedserve.scheduler_proc.decode_lane import DecodeLane, lane_ready
from pagedserve.scheduler_proc.output_processor import finish_of
from pagedserve.scheduler_proc.request import RUNNING, Sequence
from pagedserve.scheduler_proc.step import StepOutputs

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.block_pool import BlockPool

by_order = attrgetter("order")


class RunningSequences:
    def __init__(self, capacity: int, block_size: int):
        self._queue: list[Sequence] = []  # per-object, arrival order; may hold gone entries
        self._num_gone = 0  # entries of _queue finished, aborted or moved to the lane since the last step
        self._lane = DecodeLane(capacity, block_size)
        self._reserved_seats = 0  # for the children of running parents

    # ------------------------------------------------------------------ questions

    def __len__(self) -> int:
        return len(self._queue) - self._num_gone + self._lane.n

    @property
    def num_seats(self) -> int:
        """Seats in use: one per sequence, plus the children a running parent will fork into."""
        return len(self) + self._reserved_seats

    @property
    def num_steady(self) -> int:
        """Steady decodes: each computes one token every step, scheduled as one batch."""
        return self._lane.n

    def num_steady_needing_blocks(self) -> int:
        return self._lane.num_needing_blocks()

    def per_object(self) -> list[Sequence]:
        """The running sequences outside the steady batch, oldest first, as a snapshot."""
        return [seq for seq in self._queue if seq.status == RUNNING and seq.lane_pos < 0]

    def newest(self) -> Sequence:
        """The most recently arrived running sequence (FCFS's victim)."""
        queue, lane = self._queue, self._lane
        if not lane.n:
            return queue[-1]
        newest = lane.newest()
        return queue[-1] if queue and queue[-1].order > newest.order else newest

    def max_by(self, key) -> Sequence:
        """The running sequence with the largest ``key`` (the priority policy's victim): a scan,
        paid only when a sequence must give way."""
        return max(self, key=key)

    def __iter__(self):
        """Every running sequence, in no order."""
        return iter([*self.per_object(), *self._lane.seqs])

    def in_order(self) -> list[Sequence]:
        """Every running sequence, oldest first (tests, debugging)."""
        return sorted(self, key=by_order)

    # ------------------------------------------------------------------ membership

    def add(self, seq: Sequence) -> None:
        """``seq`` starts or resumes (the scheduler marks it RUNNING)."""
        if seq.is_parent:
            self._reserved_seats += seq.request.sampling.n - 1
        queue = self._queue
        if not queue or queue[-1].order < seq.order:
            queue.append(seq)
        else:
            insort(queue, seq, key=by_order)

    def discard(self, seq: Sequence) -> None:
        """``seq`` ended (finished or aborted) between steps."""
        if seq.lane_pos >= 0:
            self._lane.drop(seq)
            return
        self._num_gone += 1
        if seq.is_parent:
            self._reserved_seats -= seq.request.sampling.n - 1

    def preempt(self, seq: Sequence) -> int:
        """Take ``seq`` out during a step; returns the decode tokens it had reserved (0 or 1: a
        steady decode, whose block granted this step the scheduler then gives back unwritten)."""
        if seq.is_parent:
            self._reserved_seats -= seq.request.sampling.n - 1
        if seq.lane_pos >= 0:
            self._lane.leave(seq)
            return 1
        queue = self._queue
        if queue[-1] is seq:
            queue.pop()
        else:
            queue.remove(seq)
        return 0

    def replace(self, parent: Sequence, children: list[Sequence]) -> None:
        """A parent forked: its children take its place and the seats it reserved for them."""
        queue = self._queue
        position = queue.index(parent)
        queue[position:position + 1] = children
        self._reserved_seats -= len(children) - 1

    # ------------------------------------------------------------------ one step

    def begin_step(self, num_free_blocks: int, release=None, blocks_per_grant: int = 1) -> list[Sequence]:
        """The steady decodes whose next token starts a block, for the scheduler to grant
        (``grant_steady``) when the free blocks cover them all; when not, those leave the
        batch for the per-object loop, which decides FCFS who gets what. ``release(seq, position)``
        (a sliding window): first gives back the blocks behind each one's next query, how many.
        ``blocks_per_grant``: a hybrid model's sequence takes a block for each of its tables."""
        if self._num_gone:
            self._queue = [seq for seq in self._queue if seq.status == RUNNING and seq.lane_pos < 0]
            self._num_gone = 0
        lane = self._lane
        needy = lane.needing_blocks()
        seqs = [lane.seqs[pos] for pos in needy]
        if release is not None:  # only at a block's start: 1/block_size of the steps, read from the columns
            computed = lane.computed
            num_free_blocks += sum(release(seq, int(computed[pos])) for seq, pos in zip(seqs, needy))
        if len(seqs) * blocks_per_grant <= num_free_blocks:
            return seqs
        for seq in seqs:
            lane.leave(seq)
            insort(self._queue, seq, key=by_order)
        return []

    def grant_steady(self, seqs: list[Sequence], blocks: list[int]) -> None:
        """``blocks``, just appended to the global tables of ``seqs`` (``begin_step``'s), into the
        lane's columns and its next batch."""
        self._lane.grant_blocks([seq.lane_pos for seq in seqs], blocks)

    def steady_batch(self) -> DecodeBatch:
        """The step's batch of steady decodes (after the per-object loop and admissions)."""
        return self._lane.batch()

    def after_schedule(self) -> None:
        """The step built went out: each steady decode's token is computed (``Scheduler._update_after_schedule``)."""
        self._lane.advance()

    def after_sample(self, seq: Sequence) -> None:
        """``seq`` just sampled; once nothing but plain decodes lie ahead it joins the steady batch."""
        if seq.status == RUNNING and seq.lane_pos < 0 and lane_ready(seq):
            self._lane.enter(seq)
            self._num_gone += 1  # its entry in the queue is now stale

    def record_steady(self, tokens: list[int], deltas: list[RequestDelta], orders: list[int],
                      prefix_pool: Optional["BlockPool"]) -> tuple[StepOutputs, list[Sequence], int]:
        """The steady decodes' tokens, screened for their ends with array operations (a superset:
        a stop id of any sequence, or a length limit), each candidate then asked ``finish_of``.

        Appends an end's delta (and its sequence's order) to ``deltas`` and ``orders``; returns
        the step's outputs, the sequences that ended (for the scheduler to retire) and how many
        tokens were sampled for sequences still there. Only the
        exceptions touch a Sequence: a stop-token candidate, a sequence at its length limit, a
        block that just filled (published to the prefix cache). The tokens of sequences that
        ended or were aborted while the batch was out are already gone (``DecodeLane.record``).
        """
        lane = self._lane
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
        if prefix_pool is not None:
            filled = (new_len - 1) % lane.block_size == 0
            lane.publish_filled((filled.nonzero()[0] if in_order else where[filled]).tolist(), prefix_pool, ahead)
        m = len(tokens)
        gone = ends.nonzero()[0].tolist()
        if not gone:
            if in_order:  # sequences that entered while this batch was out sit behind its m positions
                lane.lists_out = True  # the frontend's lists share the lane's until it changes them
                request_ids = lane.request_ids if lane.n == m else lane.request_ids[:m]
                return StepOutputs(deltas, request_ids, lane.index[:m].tolist(), tokens), [], m
            ids = lane.request_ids
            return StepOutputs(deltas, [ids[pos] for pos in where.tolist()], lane.index[where].tolist(), tokens), [], m
        gone_positions = gone if in_order else where[gone].tolist()
        keep = np.ones(m, bool)
        ended_positions, ended = [], []
        seqs = lane.seqs
        for row, pos, length in zip(gone, gone_positions, new_len[gone].tolist()):
            seq = seqs[pos]
            token = tokens[row]
            if (finish := finish_of(seq, token, length)) is None:
                continue  # another sequence's stop token
            stop_token = token if finish == "stop" else None
            keep[row] = False
            ended_positions.append(pos)
            ended.append(seq)
            orders.append(seq.order)
            deltas.append(RequestDelta(seq.request_id, seq.index, [token], finish, None, None,
                                       seq.num_prompt_tokens, seq.num_cached_tokens, None, stop_token))
        ids = lane.request_ids
        kept = keep.nonzero()[0] if in_order else where[keep]
        outputs = StepOutputs(deltas, [ids[pos] for pos in kept.tolist()], lane.index[kept].tolist(),
                              values[keep].tolist())
        lane.remove_many(ended_positions)  # a batch out that holds them drops their next token (decode_lane.record)
        return outputs, ended, m

    # ------------------------------------------------------------------ debugging

    def check(self, fail) -> tuple[list[Sequence], list[Sequence]]:
        """Whether the per-object list and the lane agree; the live per-object and steady ones."""
        queue = self._queue
        per_object = [s for s in queue if s.status == RUNNING and s.lane_pos < 0]
        if len(per_object) != len(queue) - self._num_gone:
            fail(f"{self._num_gone} running entries counted gone but {len(queue) - len(per_object)} are")
        lane = self._lane
        if not len(lane.seqs) == len(lane.ids) == len(lane.request_ids) == lane.n:
            fail(f"lane holds {lane.n} sequences but lists of {len(lane.seqs)}/{len(lane.ids)}/{len(lane.request_ids)}")
        for pos, seq in enumerate(lane.seqs):
            if (seq.lane is not lane or seq.lane_pos != pos or lane.ids[pos] != seq.seq_id
                    or lane.request_ids[pos] != seq.request_id):
                fail(f"lane position {pos} holds {seq.seq_id} whose lane_pos is {seq.lane_pos}")
            if seq.status != RUNNING:
                fail(f"{seq.seq_id} ended but is still in the lane")
            if seq.is_parent or seq.shared_tail or not seq.worker_knows:
                fail(f"{seq.seq_id} in the lane is a parent, shares its tail or is unknown to the workers")
            # each step out that holds it computes one token not yet sampled (one that entered
            # while a batch was out sits behind that batch's positions)
            if len(seq.token_ids) != seq.num_kv_tokens + 1 - lane.num_batches_holding(pos):
                fail(f"{seq.seq_id} in the lane: {len(seq.token_ids)} tokens, {seq.num_kv_tokens} computed")
        steady = list(lane.seqs)
        seats = sum(s.request.sampling.n if s.is_parent else 1 for s in per_object + steady)
        if len(per_object) + len(steady) + self._reserved_seats != seats:
            fail(f"{self._reserved_seats} seats reserved for children disagree with the running parents")
        return per_object, steady


def _any_of(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.isin``, without its sort for the usual handful of stop ids."""
    if len(ids) > 8:
        return np.isin(values, ids)
    hit = values == ids[0]
    for token in ids[1:].tolist():
        hit |= values == token
    return hit
