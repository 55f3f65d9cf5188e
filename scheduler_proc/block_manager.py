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
        # Never handed out, written or zeroed: owned by the manager itself (-1: no window).
        self.null_block = self.device.take_fresh() if self.window else -1

    # ------------------------------------------------------------------ sizing

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Device blocks ``seq`` needs to compute ``num_tokens`` more tokens (copy-on-write included)."""
        needed = self.blocks_for(seq.num_kv_tokens + num_tokens) - len(seq.block_ids)
        if seq.shared_tail and self._tail_is_shared(seq):
            needed += 1
        return needed

    def _tail_is_shared(self, seq: Sequence) -> bool:
        return seq.num_kv_tokens % self.block_size != 0 and self.device.ref_counts[seq.block_ids[-1]] > 1

    def max_appendable_tokens(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could compute with the free device blocks as they are."""
        free = self.device.num_free
        if seq.shared_tail and self._tail_is_shared(seq):
            free -= 1
            if free < 0:
                return 0
        room = len(seq.block_ids) * self.block_size - seq.num_kv_tokens
        return room + free * self.block_size

    # ------------------------------------------------------------------ admission

    def can_allocate(self, hits: list[int], num_blocks: int) -> bool:
        """Room for a table of ``num_blocks`` whose leading blocks are the prefix hits ``hits``."""
        ref_counts = self.device.ref_counts
        revived = sum(1 for block in hits if ref_counts[block] == 0)  # cached but free: leave the pool
        return num_blocks - len(hits) + revived <= self.device.num_free

    def allocate(self, seq: Sequence, hits: list[int], num_blocks: int, num_behind: int = 0) -> None:
        """A table of ``num_blocks``: the prefix hits ``hits``, of which the first ``num_behind``
        lie behind the window (the null block, never taken), then fresh blocks."""
        device = self.device
        live_hits = hits[num_behind:]
        for block in live_hits:
            device.share(block)
        seq.block_ids = [self.null_block] * num_behind + live_hits + self.take_blocks_to_write(num_blocks - len(hits))
        seq.num_freed_blocks = num_behind

    def window_blocks_behind(self, seq: Sequence) -> int:
        """How many of ``seq``'s leading blocks its next query can no longer read (0: no window)."""
        if not self.window:
            return 0
        position = seq.num_kv_tokens - (len(seq.spec.drafts) if seq.spec is not None else 0)
        return blocks_behind(position, self.window, self.block_size)

    def release_behind_window(self, seq: Sequence, position: int) -> int:
        """Give back the blocks of ``seq`` that lie wholly behind the window of a query at
        ``position`` (its next token to compute); how many became free. A no-op without a window."""
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

    # ------------------------------------------------------------------ growth

    def can_append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.device.num_free

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` more tokens; copies a shared tail block before it is written."""
        device = self.device
        table = seq.block_ids
        if seq.shared_tail:
            if self._tail_is_shared(seq):
                if seq.worker_knows:
                    raise RuntimeError(f"copy-on-write for {seq.seq_id}, whose table the workers already hold")
                src = table[-1]
                dst = device.take_fresh()
                device.release(src)  # still owned by a sibling: the copy reads it this step
                self.pending_copies[dst] = src
                table[-1] = dst
            seq.shared_tail = False
        table += self.take_blocks_to_write(self.blocks_for(seq.num_kv_tokens + num_tokens) - len(table))

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
            child.shared_tail = len(children) > 1
        live = parent.block_ids[parent.num_freed_blocks:]
        for _ in range(len(children) - 1):
            for block in live:
                device.share(block)
        parent.block_ids = []
        parent.num_freed_blocks = 0

    # ------------------------------------------------------------------ release

    def free(self, seq: Sequence) -> None:
        """Give back every block ``seq`` holds, on the device and on the host."""
        device = self.device
        for block in seq.block_ids[seq.num_freed_blocks:]:
            if device.release(block):
                self._forget_pending(block)
        seq.block_ids = []
        seq.num_freed_blocks = 0
        for block in seq.host_block_ids:
            self.host.release(block)
        seq.host_block_ids = []

    def release_unused(self, seq: Sequence) -> None:
        """Give back table blocks beyond what ``seq``'s computed tokens fill (granted for a step
        it was then preempted from, so never written)."""
        keep = max(self.blocks_for(seq.num_kv_tokens), seq.num_freed_blocks)
        table = seq.block_ids
        while len(table) > keep:
            block = table.pop()
            if self.device.release(block):
                self._forget_pending(block)

    def _forget_pending(self, block: int) -> None:
        self.pending_zero.pop(block, None)
        self.pending_copies.pop(block, None)

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_ids) - seq.num_freed_blocks <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Copy every live device block of ``seq`` to a new host block (those freed behind the
        window stay freed); returns (device, host) pairs."""
        mapping = []
        host_table = []
        num_freed = seq.num_freed_blocks
        for block in seq.block_ids[num_freed:]:
            host_block = self.host.take_fresh()
            mapping.append((block, host_block))
            host_table.append(host_block)
        self.free(seq)  # a block shared with a sibling stays on the device for the sibling
        seq.host_block_ids = host_table
        seq.num_freed_blocks = num_freed  # the table comes back with them null
        return mapping

    def can_swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_kv_tokens + num_tokens) - seq.num_freed_blocks
        return needed <= self.device.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Copy every host block of ``seq`` to a fresh device block; returns (host, device) pairs."""
        mapping = []
        table = [self.null_block] * seq.num_freed_blocks
        for host_block in seq.host_block_ids:
            block = self.device.take_fresh()  # overwritten by the swap: not zeroed
            mapping.append((host_block, block))
            table.append(block)
            self.host.release(host_block)
        seq.host_block_ids = []
        seq.block_ids = table
        seq.shared_tail = False
        return mapping

    # ------------------------------------------------------------------ per step

    def drain(self) -> tuple[list[int], list[tuple[int, int]]]:
        """This step's blocks to zero and copy-on-write pairs; both lists start empty again."""
        zero = list(self.pending_zero)
        self.pending_zero.clear()
        copies = [(src, dst) for dst, src in self.pending_copies.items()]
        self.pending_copies.clear()
        return zero, copies
