"""The router's view of one replica's prefix cache: which chain hashes of full blocks it holds.

Kept true by the replica's own ``PrefixCacheEvents`` (blocks stored and evicted), never by
guesses. Anything that could make the view wrong makes it forget instead: a gap in the
messages' sequence numbers, a ``SchedulerStats`` that counts more messages than arrived, a
new scheduler pid (a restarted replica holds nothing) or a ``reset`` from the scheduler (a
fresh block pool). Forgetting only costs hits; a stale view would send requests to the
wrong replica. Bounded by the replica's block count: the view can never hold more blocks
than the cache has, however events were lost (the oldest-named go first).
"""

from __future__ import annotations

import logging
from typing import Sequence

from pagedserve.protocol.messages import PrefixCacheEvents, SchedulerStats

log = logging.getLogger(__name__)


class ReplicaCacheIndex:
    __slots__ = ("replica", "blocks", "capacity", "pid", "next_seq", "num_forgotten")

    def __init__(self, replica: int):
        self.replica = replica
        self.blocks: dict[int, None] = {}  # chain hash -> None, in the order they were named
        self.capacity = 0  # the replica's device blocks; 0 until its first stats
        self.pid = 0  # the scheduler process the view belongs to
        self.next_seq = 0  # the seq of the next PrefixCacheEvents expected from it
        self.num_forgotten = 0  # times the view was dropped because it could be wrong

    def __len__(self) -> int:
        return len(self.blocks)

    def _forget(self, why: str) -> None:
        if self.blocks:
            log.info("replica %d: forgetting %d cached blocks: %s", self.replica, len(self.blocks), why)
            self.num_forgotten += 1
        self.blocks.clear()

    def apply(self, events: PrefixCacheEvents) -> None:
        if events.pid != self.pid:
            self._forget(f"scheduler pid {self.pid} -> {events.pid}")
        elif events.seq != self.next_seq:
            self._forget(f"cache events {self.next_seq}..{events.seq - 1} were lost")
        elif events.reset:
            self._forget("the scheduler started a fresh cache")
        self.pid = events.pid
        self.next_seq = events.seq + 1
        blocks = self.blocks
        for block_hash in events.removed:
            blocks.pop(block_hash, None)
        for block_hash in events.stored:
            blocks.pop(block_hash, None)  # named again: now the newest
            blocks[block_hash] = None
        self._trim()

    def check(self, stats: SchedulerStats) -> None:
        """Cross-check with a heartbeat sent after every event message before it."""
        self.capacity = stats.num_gpu_blocks
        if stats.pid and stats.pid != self.pid:
            self._forget(f"scheduler pid {self.pid} -> {stats.pid}")
            self.pid, self.next_seq = stats.pid, stats.cache_events_sent
        elif stats.cache_events_sent != self.next_seq:
            self._forget(f"stats count {stats.cache_events_sent} cache event messages, "
                         f"{self.next_seq} arrived")
            self.next_seq = stats.cache_events_sent
        self._trim()

    def _trim(self) -> None:
        blocks = self.blocks
        if self.capacity and len(blocks) > self.capacity:
            for block_hash in list(blocks)[:len(blocks) - self.capacity]:
                del blocks[block_hash]

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica holds."""
        blocks = self.blocks
        n = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            n += 1
        return n
