"""A preallocated pool of KV blocks: reference counts, a free list and (optionally) a cache.

Every block is either free (reference count 0) or owned (count >= 1). Free blocks come
in two kinds: plain ones (a stack) and *evictable* ones, which still hold a prefix-cache
entry and are kept in least-recently-freed order (an ``OrderedDict``: O(1) removal from
the middle on a cache hit, O(1) eviction from the front). A fresh allocation takes a
plain block first and evicts the oldest cached one only when no plain block is left.

Per-block state lives in ``array``s of machine ints, which the garbage collector never
walks (a list of a few hundred thousand ints is walked by every full collection).

A pool given a ``CacheEventLog`` reports every key that enters or leaves its cache, for the
frontend's cache-aware router (only a device pool's hits matter, so only it gets one).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Hashable, Optional


class CacheEventLog:
    """Cache changes since the last ``drain``: chain hash -> True (stored) / False (removed).

    One entry per block hash, the latest state wins, so the order of application does not
    matter. Bounded: past ``MAX_PENDING`` evictions (nobody draining, e.g. a scheduler-only
    replay or bench) it keeps nothing and asks the receiver to forget instead; stores need no
    check, as there are never more of them pending than blocks plus evictions. A serving step
    drains it, and one step changes at most a few thousand blocks.
    """

    MAX_PENDING = 1 << 16
    __slots__ = ("changes", "reset_pending", "num_sent")

    def __init__(self) -> None:
        self.changes: dict[int, bool] = {}
        self.reset_pending = True  # the receiver may hold blocks of an earlier pool
        self.num_sent = 0

    def restart(self) -> "CacheEventLog":
        """A fresh, empty pool takes over: everything logged so far no longer exists."""
        self.changes.clear()
        self.reset_pending = True
        return self

    def note_removed(self, block_hash: int) -> None:
        self.changes[block_hash] = False
        if len(self.changes) > self.MAX_PENDING:
            self.restart()

    def drain(self) -> Optional[tuple[int, bool, list[int], list[int]]]:
        """(seq, reset, stored, removed) of the changes since the last drain; None if none."""
        if not self.changes and not self.reset_pending:
            return None
        stored = [h for h, present in self.changes.items() if present]
        removed = [h for h, present in self.changes.items() if not present]
        out = (self.num_sent, self.reset_pending, stored, removed)
        self.changes.clear()
        self.reset_pending = False
        self.num_sent += 1
        return out


class BlockPool:
    __slots__ = ("num_blocks", "ref_counts", "plain_free", "evictable", "block_key", "cache", "events")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = array("q", bytes(8 * num_blocks))
        # Popped from the end, so low ids go out first: reversed for readable traces.
        self.plain_free = array("q", range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # block -> its prefix-cache key or None: a list, so a step's lookups index, not hash.
        self.block_key: list[Optional[Hashable]] = [None] * num_blocks
        self.cache: dict[Hashable, int] = {}  # prefix-cache key -> block
        self.events: Optional[CacheEventLog] = None

    @property
    def num_free(self) -> int:
        return len(self.plain_free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.plain_free) - len(self.evictable)

    def take_fresh(self) -> int:
        """A free block for new content, evicting the least recently freed cached one if needed."""
        if self.plain_free:
            block = self.plain_free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            key = self.block_key[block]
            del self.cache[key]
            self.block_key[block] = None
            if self.events is not None and len(key) == 3:  # a local group's key (prefix_cache.py) is not the router's
                self.events.note_removed(key[2])
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more owner for a block that is owned or cached (a prefix hit or a fork)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> bool:
        """Drop one owner; True when the block became free."""
        count = self.ref_counts[block] - 1
        self.ref_counts[block] = count
        if count:
            return False
        if self.block_key[block] is None:
            self.plain_free.append(block)
        else:
            self.evictable[block] = None
        return True

    def lookup(self, key: Hashable) -> Optional[int]:
        return self.cache.get(key)

    def register(self, block: int, key: Hashable) -> None:
        """Publish a full, computed block under ``key``; the first block to claim a key keeps it."""
        if self.block_key[block] is None and self.cache.setdefault(key, block) == block:  # one key hash
            self.block_key[block] = key
            events = self.events
            if events is not None and len(key) == 3:
                events.changes[key[2]] = True  # inlined: once per block filled, on the hot path
