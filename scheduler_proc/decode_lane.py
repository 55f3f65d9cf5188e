"""The decode lane: running sequences in steady decode, held as numpy columns.

Most of a busy step is sequences that each compute one token, the one sampled for them in
the step before. As Python objects each of those costs a dozen scattered memory touches per
step (the sequence, its token array, its block list, a message struct, a delta struct, the
int objects in between), and once a few thousand of them outgrow the CPU caches the cost per
sequence climbs: 4096 sequences cost 10x what 1024 do, not 4x. In the lane their per-step
state is a few contiguous int64 columns, a step is a handful of array operations, and only
the exceptions (a filled block, a stop token candidate, the end) touch a Sequence.

A sequence enters after a step that sampled for it, when nothing but decodes lie ahead:
the workers hold it, it is no parent waiting to fork, its last block is its own and it wants
no logprobs. While it is in the lane these columns are the one store of its progress
(``num_kv_tokens``, the sent counters) and of its newest tokens (a ring of the last ``RING``
sampled tokens per sequence, flushed to its token array in turn); the sequence, a
``LaneSequence`` meanwhile, reads through to them and gets them back when it leaves. Its
block table stays the Sequence's alone: the block manager appends a block granted to it at
once (a sequence in 1/block_size of the steps).

Positions are dense (0..n-1) and a removal moves the last sequence into the gap, so lane
order means nothing; FCFS order stays in ``Sequence.order`` (see ``newest``). Each batch out
remembers where its rows went (``in_flight``): at first row i is position i, and a removal
while it is out rewrites that map (the ended row to -1, the moved row to its new position),
so its result lands where its sequences are now and an ended sequence's extra token is
dropped. An end therefore never holds the next step back.

Overlapped scheduling: with one batch in flight the lane may schedule the next, each
sequence computing the token the in-flight step samples for it, sent as a placeholder the
workers resolve (``Scheduler.can_schedule_ahead``). A sequence may enter while a batch is
out (its first token arrived while it sat out the step ahead): it takes the next position,
which no batch out holds, and its ring starts at the update after theirs, so the ring's clock
stays one update per result for every sequence a batch holds. Only ends leave while a batch
out holds the sequence: a sequence leaving for the per-object path needs its token in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedserve.protocol.messages import DecodeBatch
from pagedserve.protocol.step_state import PLACEHOLDER_TOKEN

from pagedserve.scheduler_proc import prefix_cache
from pagedserve.scheduler_proc.request import Sequence

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.block_pool import BlockPool

RING = 128  # sampled tokens a sequence may hold in the lane before they are flushed to it
EMPTY_DECODES = DecodeBatch([], [], [], [])  # never mutated
_NO_GRANTS = (np.zeros(0, np.int64), [])  # never mutated


_own_token_ids = Sequence.token_ids  # the slot behind LaneSequence.token_ids


class LaneSequence(Sequence):
    """A ``Sequence`` while the lane holds it: its class while it is there (a class swap, so the
    per-object path pays nothing for the view), its progress read from the columns, its token
    array topped up from the ring when read. Its progress cannot be written: the lane alone
    advances it, and hands it back to the object when the sequence leaves."""

    __slots__ = ()

    @property
    def token_ids(self):
        self.lane.flush(self.lane_pos)
        return _own_token_ids.__get__(self)

    @property
    def num_kv_tokens(self) -> int:
        return int(self.lane.computed[self.lane_pos])

    num_tokens_sent = num_kv_tokens  # all but the newest token, which its next batch carries

    @property
    def num_blocks_sent(self) -> int:
        return len(self.block_ids)  # each batch carries its grants


def lane_kind(seq: "Sequence") -> bool:
    """Whether ``seq`` is of the kind the lane holds: no fork to come, no shared tail to copy,
    no logprobs, no grammar (its mask needs its previous token: never overlapped, grammar.py),
    no speculation going on."""
    return (not seq.is_parent and not seq.shared_tail and not seq.want_logprobs and seq.grammar is None
            and (seq.spec is None or seq.spec.off))  # a speculating one proposes per object (speculation.py)


def lane_ready(seq: "Sequence") -> bool:
    """True when ``seq`` (running, just sampled) has nothing but plain decodes ahead."""
    return (seq.worker_knows and lane_kind(seq)
            and len(seq.token_ids) == seq.num_kv_tokens + 1 == seq.num_tokens_sent + 1
            and seq.num_blocks_sent == len(seq.block_ids))


class DecodeLane:
    def __init__(self, capacity: int, block_size: int):
        self.block_size = block_size
        self.n = 0
        self.seqs: list[Sequence] = []
        # Handed to messages as they are, so replaced (copy on write), never mutated, once out.
        self.ids: list[str] = []  # seq ids, for the DecodeBatch
        self.request_ids: list[str] = []  # for the frontend's token lists
        self.lists_out = False
        columns = ("computed", "table_tokens", "max_len", "min_len", "order", "index", "last", "since",
                   "entered", "tail_block", "before_tail_block", "key_hash", "num_keyed")
        self._columns = [np.zeros(capacity, np.int64) for _ in columns]
        (self.computed,  # tokens with KV; +1 as soon as a step is scheduled
         self.table_tokens,  # tokens the block table can hold
         self.max_len, self.min_len, self.order, self.index,
         self.last,  # the newest token, not yet sent to the workers
         self.since,  # clock value from which this sequence's ring slots are not yet flushed
         self.entered,  # clock value at entry: ring slots from here on are this sequence's tokens
         # For publishing filled blocks to the prefix cache without reading the sequence:
         self.tail_block,  # the last block of the table
         self.before_tail_block,  # the one before it: the block that filled when a step ahead took a new one
         self.key_hash,  # own hash of the last prefix-cache key (the next key's parent)
         self.num_keyed,  # len(seq.block_keys)
         ) = self._columns
        # ring[pos, clock % RING]: the token of that update; a row per sequence, read whole on a flush.
        self.ring = np.zeros((capacity, RING), np.int64)
        self.clock = 0  # results applied
        # Per DecodeBatch out, oldest first, where its rows are now: n (row i is position i, for
        # i < n, untouched since it left) or an array of positions, -1 for a sequence gone.
        self.in_flight: list = []
        self._granted = _NO_GRANTS  # positions and the blocks granted them this step
        self._stop_counts: dict[int, int] = {}
        self._stop_ids = np.zeros(0, np.int64)
        self._stop_dirty = False

    # ------------------------------------------------------------------ membership

    def _own_lists(self) -> None:
        if self.lists_out:
            self.ids, self.request_ids, self.lists_out = list(self.ids), list(self.request_ids), False

    def enter(self, seq: "Sequence") -> None:
        self._own_lists()
        pos = self.n
        self.n += 1
        self.seqs.append(seq)
        self.ids.append(seq.seq_id)
        self.request_ids.append(seq.request_id)
        tokens = seq.token_ids
        self.computed[pos] = seq.num_kv_tokens
        self.table_tokens[pos] = len(seq.block_ids) * self.block_size
        self.max_len[pos] = seq.max_len
        self.min_len[pos] = seq.min_len
        self.order[pos] = seq.order
        self.index[pos] = seq.index
        self.last[pos] = tokens[-1]
        # Entering while batches are out (that do not hold it): its first ring slot is the
        # update after theirs, so nothing is flushed from it until then.
        self.since[pos] = self.entered[pos] = self.clock + len(self.in_flight)
        self.tail_block[pos] = seq.block_ids[-1]
        self.before_tail_block[pos] = seq.block_ids[-2] if len(seq.block_ids) > 1 else -1
        self.note_keys(pos, seq)
        seq.lane, seq.lane_pos = self, pos
        seq.__class__ = LaneSequence  # its progress is read from the columns from now on
        for token in seq.stop_token_ids:
            self._stop_counts[token] = self._stop_counts.get(token, 0) + 1
            self._stop_dirty = True

    def note_keys(self, pos: int, seq: "Sequence") -> None:
        keys = seq.block_keys
        self.key_hash[pos] = keys[-1][2] if keys else seq.request.prefix_seed
        self.num_keyed[pos] = len(keys)

    def flush(self, pos: int) -> None:
        """Move the ring's tokens of the sequence at ``pos`` to its token array (``Sequence.token_ids``)."""
        clock, start = self.clock, int(self.since[pos])
        if clock > start:  # else it entered behind batches still out: nothing of its own yet
            row, first, end = self.ring[pos], start % RING, clock % RING
            _own_token_ids.__get__(self.seqs[pos]).frombytes(  # raw int64: no int object per token
                row[first:end].tobytes() if first < end  # first == end: RING tokens, the whole row wrapped
                else row[first:].tobytes() + row[:end].tobytes())
            self.since[pos] = clock

    def num_batches_holding(self, pos: int) -> int:
        """How many batches out compute a token for the sequence now at ``pos``."""
        return sum(pos < held if isinstance(held, int) else bool((held == pos).any()) for held in self.in_flight)

    def leave(self, seq: "Sequence") -> None:
        """Back to the per-object path, its lane position given up."""
        pos = seq.lane_pos
        if self.num_batches_holding(pos):  # its token in flight would be dropped (Scheduler.can_schedule_ahead, rule 2)
            raise RuntimeError(f"{seq.seq_id} left the decode lane while a batch out computes its token")
        self._remove(pos)

    def drop(self, seq: "Sequence") -> None:
        """``seq`` ended outside the lane's own step (an abort). A batch out that holds it computes
        a token that its result then drops."""
        self._remove(seq.lane_pos)

    def _remove(self, pos: int) -> None:
        """The sequence at ``pos`` leaves: its tokens and progress handed back to it (one store
        at a time), the last position moved into the gap."""
        self._own_lists()
        last = self.n - 1
        seq = self.seqs[pos]
        self.flush(pos)
        computed = int(self.computed[pos])
        seq.__class__ = Sequence
        seq.lane, seq.lane_pos = None, -1
        seq.num_kv_tokens = seq.num_tokens_sent = computed
        seq.num_blocks_sent = len(seq.block_ids)
        for i, held in enumerate(self.in_flight):
            if isinstance(held, int):
                if pos >= held:  # this batch holds neither pos nor last (> pos)
                    continue
                held = self.in_flight[i] = np.arange(held)
            held[held == pos] = -1
            held[held == last] = pos
        if pos != last:
            for column in self._columns:
                column[pos] = column[last]
            self.ring[pos] = self.ring[last]
            moved = self.seqs[pos] = self.seqs[last]
            moved.lane_pos = pos
            self.ids[pos] = self.ids[last]
            self.request_ids[pos] = self.request_ids[last]
        granted_pos, granted_blocks = self._granted
        if granted_blocks:  # a preemption between grant_blocks and schedule moves positions
            keep = granted_pos != pos
            granted_pos = granted_pos[keep]
            granted_pos[granted_pos == last] = pos
            self._granted = (granted_pos, [b for b, k in zip(granted_blocks, keep.tolist()) if k])
        self.seqs.pop()
        self.ids.pop()
        self.request_ids.pop()
        self.n = last
        for token in seq.stop_token_ids:
            count = self._stop_counts[token] - 1
            if count:
                self._stop_counts[token] = count
            else:
                del self._stop_counts[token]
            self._stop_dirty = True

    def remove_many(self, positions) -> None:
        """Remove several positions (from one step's result); highest first keeps the rest valid."""
        for pos in sorted(positions, reverse=True):
            self._remove(pos)

    def newest(self) -> "Sequence":
        return self.seqs[int(np.argmax(self.order[:self.n]))]

    # ------------------------------------------------------------------ one step

    def needing_blocks(self) -> list[int]:
        """The positions whose next token starts a block."""
        n = self.n
        return (self.computed[:n] >= self.table_tokens[:n]).nonzero()[0].tolist()

    def grant_blocks(self, needy: list[int], blocks: list[int]) -> None:
        """``blocks``, one for each position of ``needing_blocks``, which the block manager just
        appended to their tables (the workers learn them from this step's batch)."""
        self.before_tail_block[needy] = self.tail_block[needy]
        self.tail_block[needy] = blocks
        self.table_tokens[needy] += self.block_size
        self._granted = (np.asarray(needy, np.int64), blocks)

    def batch(self) -> DecodeBatch:
        """The step's batch for the workers: every sequence in the lane computes its newest token."""
        n = self.n
        if n == 0:
            return EMPTY_DECODES
        granted_pos, granted_blocks = self._granted
        # With a batch still out, every token to compute is being sampled there right now.
        tokens = [PLACEHOLDER_TOKEN] * n if self.in_flight else self.last[:n].tolist()
        new_blocks = list(zip(granted_pos.tolist(), granted_blocks))
        return DecodeBatch(self.ids, self.computed[:n].tolist(), tokens, new_blocks)

    def advance(self) -> None:
        """The step's batch went out: each sequence's newest token is computed, its grant sent."""
        self._granted = _NO_GRANTS
        n = self.n
        if n:
            self.lists_out = True  # the batch holds ``ids``
            self.computed[:n] += 1
            self.in_flight.append(n)

    def num_needing_blocks(self) -> int:
        """Sequences whose next token starts a block (``len(needing_blocks())``, counted)."""
        n = self.n
        return int((self.computed[:n] >= self.table_tokens[:n]).sum())

    def record(self, tokens: list[int]) -> tuple:
        """Append the oldest batch out's sampled tokens (in batch order) to its sequences.

        Returns where they went and the tokens kept: ``(slice(0, n), all of them)`` when the
        batch's rows are still positions 0..n-1, else (positions, tokens) without the rows of
        sequences gone since it was sent.
        """
        held = self.in_flight.pop(0)
        values = np.array(tokens, dtype=np.int64)
        if isinstance(held, int):
            where = slice(0, held)
        else:
            kept = held >= 0
            where, values = held[kept], values[kept]
        # Every position is flushed once per RING updates, a different 1/RING of them each time
        # (sequences that entered together would otherwise all flush in the same step); a
        # sequence moved to a position flushed before its turn is caught by the first test,
        # when the slot written next would be its oldest unflushed token.
        clock = self.clock
        due = clock - self.since[where] >= RING
        if isinstance(where, slice):
            due[(-clock) % RING::RING] = True
            positions = due.nonzero()[0].tolist()
        else:
            due |= where % RING == (-clock) % RING
            positions = where[due].tolist()
        for pos in positions:
            self.flush(pos)
        self.ring[where, clock % RING] = values
        self.last[where] = values
        self.clock += 1
        return where, values

    def publish_filled(self, positions: list[int], pool: "BlockPool", ahead: int = 0) -> None:
        """Name, in the prefix cache, the block each sequence at ``positions`` just filled.

        When the ring holds all of the block's tokens and every earlier block is named, the
        key comes from the ring and the key columns, without touching the sequence's token array,
        one of the scattered objects that thousands of sequences no longer keep in cache.
        Otherwise it is named the per-object way (reading it flushes its ring).
        ``ahead``: steps out beyond the one whose result this is (already in ``computed``).
        """
        if not positions:
            return
        bs = self.block_size
        where = np.asarray(positions, np.int64)
        first_update = self.clock - 1 - bs  # the update that sampled the block's first token
        fast = ((self.num_keyed[where] == (self.computed[where] - ahead) // bs - 1)
                & (self.entered[where] <= first_update) & (bs < RING))
        if self.seqs[positions[0]].window_tables:  # a hybrid model's local tables are named per object too
            fast[:] = False
        for pos in where[~fast].tolist():
            seq = self.seqs[pos]
            prefix_cache.register_computed(pool, seq, bs)
            self.note_keys(pos, seq)
        where = where[fast]
        if not len(where):
            return
        slots = np.arange(first_update, self.clock - 1) % RING
        tokens = self.ring[where[:, None], slots].tobytes()  # one row of bs int64 per sequence
        # A step scheduled ahead has already given the next token its block: the one that filled
        # is the one before the tail.
        tails = self.before_tail_block if ahead else self.tail_block
        size = 8 * bs
        owns = []
        seqs = self.seqs
        for i, (pos, parent, block) in enumerate(zip(where.tolist(), self.key_hash[where].tolist(),
                                                     tails[where].tolist())):
            key = prefix_cache.block_key(parent, tokens[i * size:(i + 1) * size])
            pool.register(block, key)
            seqs[pos].block_keys.append(key)
            owns.append(key[2])
        self.key_hash[where] = owns
        self.num_keyed[where] += 1

    def stop_ids(self) -> np.ndarray:
        """Every stop token of a sequence in the lane: a superset for the first, vectorized check."""
        if self._stop_dirty:
            self._stop_ids = np.fromiter(self._stop_counts, np.int64, len(self._stop_counts))
            self._stop_dirty = False
        return self._stop_ids
