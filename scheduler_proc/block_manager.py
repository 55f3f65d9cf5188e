"""Per-sequence block bookkeeping on a device pool and a host (swap) pool.

Check-then-commit: every mutation (``allocate``, ``append_slots``, ``swap_out``,
``swap_in``) assumes its ``can_*`` question was just answered yes.

Cache operations it records for the next ``SchedulerOutput`` (drained by ``drain``):

* ``pending_zero``: every device block handed out fresh *for writing* (``allocate``,
  ``append_slots``), exactly once per hand-out. Not listed: prefix-cache hits (their KV is
  valid), swap-in destinations and copy-on-write destinations: the workers apply
  swap out, swap in, copy, zero in that order, so zeroing those would wipe what the swap
  or the copy just wrote, and the swap/copy overwrites the whole block anyway.
* ``pending_copies``: copy-on-write ``(src, dst)`` pairs, keyed by ``dst``.

A pending block that becomes free again before the output is built is dropped from both
lists (it was never written); if it is handed out again it is listed again, once.

With a sliding window on every layer (``SchedulerConfig.sliding_window``), blocks behind the
window go back to the pool as the sequence advances (``release_behind_window``); their table
entries become the null block, reserved here at start, and ``seq.num_freed_blocks`` counts them:
everything that walks a table's blocks walks ``block_ids[num_freed_blocks:]`` (sliding_window.py).

Where global and local layers alternate (``SchedulerConfig.num_window_groups``, protocol/kv_groups.py),
a sequence holds one table per group, all of one length: ``block_ids`` for the global group, which
keeps every block, and ``window_tables`` for the local groups, whose blocks behind
``hybrid_window`` are freed to the null block (``num_window_freed`` of them). Every group draws on
the one device pool, so each count of blocks here is summed over the tables (``num_tables``); a
block id belongs to one group's table at a time. Swap, copy and zero stay per block id. A steady
decode starting a block takes one for each table (``append_global_blocks``, ``append_local_blocks``).
"""

from __future__ import annotations

from pagedserve.scheduler_proc.block_pool import BlockPool
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.request import Sequence
from pagedserve.scheduler_proc.sliding_window import blocks_behind


class BlockManager:
    def __init__(self, config: SchedulerConfig):
        self.block_size = config.block_size
        self.device = BlockPool(config.num_gpu_blocks)
        self.host = BlockPool(config.num_cpu_blocks)
        self.pending_zero: dict[int, None] = {}  # an ordered set
        self.pending_copies: dict[int, int] = {}  # dst -> src
        self.window = config.sliding_window
        self.num_window_groups = config.num_window_groups
        self.hybrid_window = config.hybrid_window
        self.num_tables = 1 + self.num_window_groups  # block tables per sequence
        # Never handed out, written or zeroed: owned by the manager itself (-1: no window).
        self.null_block = self.device.take_fresh() if self.window or self.num_window_groups else -1

    @property
    def frees_behind_window(self) -> bool:
        """Whether some table of a sequence gives back its blocks behind a window."""
        return bool(self.window or self.num_window_groups)

    # ------------------------------------------------------------------ sizing

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Device blocks ``seq`` needs to compute ``num_tokens`` more tokens (copy-on-write included)."""
        needed = self.blocks_for(seq.num_kv_tokens + num_tokens) - len(seq.block_ids)
        if seq.shared_tail and self._tail_is_shared(seq):
            needed += 1
        return needed * self.num_tables  # every table grows alike, and a shared tail is shared in each

    def num_extra_fitting(self, seq: Sequence, num_tokens: int, extra: int, blocks_to_leave: int) -> int:
        """How many of ``extra`` tokens after ``num_tokens`` more ``seq`` can have blocks for while
        ``blocks_to_leave`` stay free (a speculating decode's proposals)."""
        base = self.num_new_blocks(seq, num_tokens)
        spare = self.device.num_free - base - blocks_to_leave
        while extra and self.num_new_blocks(seq, num_tokens + extra) - base > spare:
            extra -= 1
        return extra

    def _tail_is_shared(self, seq: Sequence) -> bool:
        return seq.num_kv_tokens % self.block_size != 0 and self.device.ref_counts[seq.block_ids[-1]] > 1

    def max_appendable_tokens(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could compute with the free device blocks as they are."""
        free = self.device.num_free
        if seq.shared_tail and self._tail_is_shared(seq):
            free -= self.num_tables
            if free < 0:
                return 0
        room = len(seq.block_ids) * self.block_size - seq.num_kv_tokens
        return room + free // self.num_tables * self.block_size

    # ------------------------------------------------------------------ admission

    def can_allocate(self, hits: list[int], num_blocks: int) -> bool:
        """Room for tables of ``num_blocks`` entries in all that hold the prefix hits ``hits``."""
        ref_counts = self.device.ref_counts
        revived = sum(1 for block in hits if ref_counts[block] == 0)  # cached but free: leave the pool
        return num_blocks - len(hits) + revived <= self.device.num_free

    def allocate(self, seq: Sequence, hits: list[int], num_blocks: int, num_behind: int = 0,
                 window_hits: tuple[list[int], ...] = (), window_behind: int = 0) -> None:
        """A table of ``num_blocks``: the prefix hits ``hits``, of which the first ``num_behind``
        lie behind the window (the null block, never taken), then fresh blocks. A hybrid model's
        local tables: ``window_behind`` null blocks, their group's hits ``window_hits`` (the
        blocks of ``hits``' span from ``window_behind`` on), then fresh blocks."""
        device = self.device
        live_hits = hits[num_behind:]
        window_hits = window_hits or ([],) * self.num_window_groups
        for block in live_hits + [block for group_hits in window_hits for block in group_hits]:
            device.share(block)  # every hit out of the pool before a fresh block could evict one
        num_fresh = num_blocks - len(hits)
        seq.block_ids = [self.null_block] * num_behind + live_hits + self.take_blocks_to_write(num_fresh)
        seq.num_freed_blocks = num_behind
        if self.num_window_groups:
            seq.window_tables = [[self.null_block] * window_behind + list(group_hits) + self.take_blocks_to_write(num_fresh)
                                 for group_hits in window_hits]
            seq.num_window_freed = window_behind

    def window_blocks_behind(self, seq: Sequence) -> int:
        """How many of ``seq``'s leading blocks its next query can no longer read (0: no window)."""
        if not self.window:
            return 0
        position = seq.num_kv_tokens - (len(seq.spec.drafts) if seq.spec is not None else 0)
        return blocks_behind(position, self.window, self.block_size)

    def window_tables_behind(self, seq: Sequence) -> int:
        """How many leading entries of ``seq``'s local tables its next query can no longer read."""
        if not self.num_window_groups:
            return 0
        position = seq.num_kv_tokens - (len(seq.spec.drafts) if seq.spec is not None else 0)
        return blocks_behind(position, self.hybrid_window, self.block_size)

    def release_behind_window(self, seq: Sequence, position: int) -> int:
        """Give back the blocks of ``seq`` that lie wholly behind the window of a query at
        ``position`` (its next token to compute); how many became free. A no-op without a window."""
        if self.num_window_groups:
            return self._release_window_tables(seq, position)
        if not self.window:
            return 0
        behind = min(blocks_behind(position, self.window, self.block_size), len(seq.block_ids) - 1)
        start = seq.num_freed_blocks
        if behind <= start:
            return 0
        table, device, null = seq.block_ids, self.device, self.null_block
        freed = 0
        for i in range(start, behind):
            if device.release(table[i]):  # a block a sibling still holds stays its
                self._forget_pending(table[i])
                freed += 1
            table[i] = null
        seq.num_freed_blocks = behind
        return freed

    def _release_window_tables(self, seq: Sequence, position: int) -> int:
        """The local tables' part of ``release_behind_window``; the global table keeps every block."""
        behind = min(blocks_behind(position, self.hybrid_window, self.block_size), len(seq.block_ids) - 1)
        start = seq.num_window_freed
        if behind <= start:
            return 0
        device, null = self.device, self.null_block
        freed = 0
        for table in seq.window_tables:
            for i in range(start, behind):
                if device.release(table[i]):
                    self._forget_pending(table[i])
                    freed += 1
                table[i] = null
        seq.num_window_freed = behind
        return freed

    # ------------------------------------------------------------------ growth

    def can_append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.device.num_free

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` more tokens; copies a shared tail block before it is written."""
        tables = [seq.block_ids, *seq.window_tables]
        if seq.shared_tail:
            if self._tail_is_shared(seq):
                if seq.worker_knows:
                    raise RuntimeError(f"copy-on-write for {seq.seq_id}, whose table the workers already hold")
                for table in tables:
                    self._copy_tail(table)
            seq.shared_tail = False
        count = self.blocks_for(seq.num_kv_tokens + num_tokens) - len(seq.block_ids)
        for table in tables:
            table += self.take_blocks_to_write(count)

    def _copy_tail(self, table: list[int]) -> None:
        """A fresh copy of ``table``'s last block in its place (copy-on-write)."""
        device = self.device
        src = table[-1]
        dst = device.take_fresh()
        device.release(src)  # still owned by a sibling: the copy reads it this step
        self.pending_copies[dst] = src
        table[-1] = dst

    def append_global_blocks(self, seqs: list[Sequence]) -> list[int]:
        """A fresh block at the end of each of ``seqs``' global tables (steady decodes starting a
        block), taken in one call; the blocks, in order."""
        blocks = self.take_blocks_to_write(len(seqs))
        for seq, block in zip(seqs, blocks):
            seq.block_ids.append(block)
        return blocks

    def append_local_blocks(self, seq: Sequence) -> list[list[int]]:
        """A fresh block at the end of each local table of ``seq`` (its global table just took
        one); each table's new block, as the step sends them."""
        grants = []
        for table in seq.window_tables:
            grant = self.take_blocks_to_write(1)
            table += grant
            grants.append(grant)
        return grants

    def take_blocks_to_write(self, count: int) -> list[int]:
        """``count`` fresh device blocks, each listed for zeroing once (none for count <= 0)."""
        take, pending = self.device.take_fresh, self.pending_zero
        blocks = [take() for _ in range(count)]
        for block in blocks:
            pending[block] = None
        return blocks

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children take over the parent's blocks: each block gains ``len(children) - 1`` owners."""
        device = self.device
        for child in children:
            child.block_ids = list(parent.block_ids)
            child.num_freed_blocks = parent.num_freed_blocks
            child.window_tables = [list(table) for table in parent.window_tables]
            child.num_window_freed = parent.num_window_freed
            child.shared_tail = len(children) > 1
        live = self._live_blocks(parent)
        for _ in range(len(children) - 1):
            for block in live:
                device.share(block)
        parent.block_ids = []
        parent.num_freed_blocks = 0
        parent.window_tables = []
        parent.num_window_freed = 0

    @staticmethod
    def _live_blocks(seq: Sequence) -> list[int]:
        """Every device block ``seq``'s tables hold (not the null block), global table first."""
        live = seq.block_ids[seq.num_freed_blocks:]
        for table in seq.window_tables:
            live += table[seq.num_window_freed:]
        return live

    # ------------------------------------------------------------------ release

    def free(self, seq: Sequence) -> None:
        """Give back every block ``seq`` holds, on the device and on the host."""
        device = self.device
        for block in self._live_blocks(seq):
            if device.release(block):
                self._forget_pending(block)
        seq.block_ids = []
        seq.num_freed_blocks = 0
        seq.window_tables = []
        seq.num_window_freed = 0
        for block in seq.host_block_ids:
            self.host.release(block)
        for table in seq.window_host_tables:
            for block in table:
                self.host.release(block)
        seq.host_block_ids = []
        seq.window_host_tables = []

    def release_unused(self, seq: Sequence) -> None:
        """Give back table blocks beyond what ``seq``'s computed tokens fill (granted for a step
        it was then preempted from, so never written)."""
        keep = max(self.blocks_for(seq.num_kv_tokens), seq.num_freed_blocks, seq.num_window_freed)
        for table in (seq.block_ids, *seq.window_tables):
            while len(table) > keep:
                block = table.pop()
                if self.device.release(block):
                    self._forget_pending(block)

    def _forget_pending(self, block: int) -> None:
        self.pending_zero.pop(block, None)
        self.pending_copies.pop(block, None)

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, seq: Sequence) -> bool:
        live = len(seq.block_ids) - seq.num_freed_blocks
        live += self.num_window_groups * (len(seq.block_ids) - seq.num_window_freed) if seq.window_tables else 0
        return live <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Copy every live device block of ``seq`` to a new host block (those freed behind the
        window stay freed); returns (device, host) pairs."""
        mapping: list[tuple[int, int]] = []
        num_freed, num_window_freed = seq.num_freed_blocks, seq.num_window_freed
        host_table = self._to_host(seq.block_ids[num_freed:], mapping)
        window_host = [self._to_host(table[num_window_freed:], mapping) for table in seq.window_tables]
        self.free(seq)  # a block shared with a sibling stays on the device for the sibling
        seq.host_block_ids = host_table
        seq.window_host_tables = window_host
        seq.num_freed_blocks = num_freed  # the tables come back with them null
        seq.num_window_freed = num_window_freed
        return mapping

    def _to_host(self, blocks: list[int], mapping: list[tuple[int, int]]) -> list[int]:
        """A new host block for each of ``blocks``, the (device, host) pairs added to ``mapping``."""
        host_table = []
        for block in blocks:
            host_block = self.host.take_fresh()
            mapping.append((block, host_block))
            host_table.append(host_block)
        return host_table

    def can_swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        num_blocks = self.blocks_for(seq.num_kv_tokens + num_tokens)
        needed = num_blocks - seq.num_freed_blocks
        if seq.window_host_tables:
            needed += self.num_window_groups * (num_blocks - seq.num_window_freed)
        return needed <= self.device.num_free

    def swap_in_room(self, seq: Sequence) -> int:
        """The most tokens swapped ``seq`` could compute on coming back, with the free device blocks
        as they are: each table takes its live blocks back and grows alike."""
        most_blocks = ((self.device.num_free + seq.num_freed_blocks + self.num_window_groups * seq.num_window_freed)
                       // self.num_tables)
        return most_blocks * self.block_size - seq.num_kv_tokens

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Copy every host block of ``seq`` to a fresh device block; returns (host, device) pairs."""
        mapping: list[tuple[int, int]] = []
        seq.block_ids = [self.null_block] * seq.num_freed_blocks + self._to_device(seq.host_block_ids, mapping)
        seq.window_tables = [[self.null_block] * seq.num_window_freed + self._to_device(table, mapping)
                             for table in seq.window_host_tables]
        seq.host_block_ids = []
        seq.window_host_tables = []
        seq.shared_tail = False
        return mapping

    def _to_device(self, host_blocks: list[int], mapping: list[tuple[int, int]]) -> list[int]:
        """A fresh device block for each of ``host_blocks`` (overwritten by the swap: not zeroed),
        the host ones given back, the (host, device) pairs added to ``mapping``."""
        blocks = []
        for host_block in host_blocks:
            block = self.device.take_fresh()
            mapping.append((host_block, block))
            blocks.append(block)
            self.host.release(host_block)
        return blocks

    # ------------------------------------------------------------------ per step

    def drain(self) -> tuple[list[int], list[tuple[int, int]]]:
        """This step's blocks to zero and copy-on-write pairs; both lists start empty again."""
        zero = list(self.pending_zero)
        self.pending_zero.clear()
        copies = [(src, dst) for dst, src in self.pending_copies.items()]
        self.pending_copies.clear()
        return zero, copies
