"""A full consistency check of the scheduler and its block pools, for debug runs and tests.

O(blocks + tokens): run it after every step only with ``debug_invariants``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedserve.scheduler_proc.block_pool import BlockPool
from pagedserve.scheduler_proc.request import RUNNING, SWAPPED, WAITING

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.scheduler import Scheduler


class InvariantError(AssertionError):
    """The scheduler's state contradicts itself; the message names what and where."""


def _fail(message: str) -> None:
    raise InvariantError(message)


def check_pool(pool: BlockPool, owners: Counter, name: str) -> None:
    """Every block is free (count 0) or owned with a count equal to the tables holding it."""
    plain, evictable = pool.plain_free, pool.evictable
    if len(set(plain)) != len(plain):
        _fail(f"{name}: a block is twice in the free list")
    free = set(plain)
    both = free & evictable.keys()
    if both:
        _fail(f"{name}: blocks {sorted(both)} are both plain-free and evictable")
    free |= evictable.keys()
    for block in range(pool.num_blocks):
        count = pool.ref_counts[block]
        if count != owners.get(block, 0):
            _fail(f"{name}: block {block} has ref count {count} but {owners.get(block, 0)} tables hold it")
        if (count == 0) != (block in free):
            _fail(f"{name}: block {block} with ref count {count} is {'' if block in free else 'not '}free")
    if len(free) + sum(1 for c in pool.ref_counts if c) != pool.num_blocks:
        _fail(f"{name}: free {len(free)} + used != total {pool.num_blocks}")
    for block in evictable:
        if pool.block_key[block] is None:
            _fail(f"{name}: evictable block {block} has no prefix-cache key")
    for key, block in pool.cache.items():
        if pool.block_key[block] != key:
            _fail(f"{name}: cache entry for block {block} does not match the block's key")
    if sum(key is not None for key in pool.block_key) != len(pool.cache):
        _fail(f"{name}: {len(pool.cache)} cache entries but a different number of named blocks")


def check(sched: "Scheduler") -> None:
    bm = sched.bm
    if bm.pending_zero or bm.pending_copies:
        _fail(f"pending zero {list(bm.pending_zero)} / copies {bm.pending_copies} not drained")
    device_owners: Counter = Counter()
    host_owners: Counter = Counter()
    per_object, steady = sched.running.check(_fail)
    live = per_object + steady
    seats = sum(s.request.sampling.n if s.is_parent else 1 for s in live)
    if seats > sched.config.max_num_seqs:
        _fail(f"{seats} seats in use exceed max_num_seqs={sched.config.max_num_seqs}")
    for queue, status, name in ((per_object, RUNNING, "running"), (steady, RUNNING, "steady"),
                                (sched.waiting, WAITING, "waiting"), (sched.swapped, SWAPPED, "swapped")):
        orders = [s.order for s in queue]
        if name != "steady" and orders != sorted(orders):
            _fail(f"{name} is not in arrival order: {[s.seq_id for s in queue]}")
        for seq in queue:
            if seq.status != status:
                _fail(f"{seq.seq_id} is in {name} with status {seq.status}")
            if sched.requests.get(seq.request.request_id) is not seq.request:
                _fail(f"{seq.seq_id} is queued but its request is not registered")
            device_owners.update(seq.block_ids)
            host_owners.update(seq.host_block_ids)
            expected = bm.blocks_for(seq.num_kv_tokens)
            if status == RUNNING and len(seq.block_ids) != expected:
                _fail(f"{seq.seq_id}: {len(seq.block_ids)} blocks for {seq.num_kv_tokens} computed tokens")
            if status == WAITING and (seq.block_ids or seq.host_block_ids or seq.num_kv_tokens):
                _fail(f"waiting {seq.seq_id} holds blocks or computed tokens")
            if status == SWAPPED and (seq.block_ids or len(seq.host_block_ids) != expected):
                _fail(f"swapped {seq.seq_id}: device {seq.block_ids}, host {seq.host_block_ids}")
            if len(seq.block_keys) > seq.num_kv_tokens // bm.block_size:
                _fail(f"{seq.seq_id} names more blocks than it has computed")
    for block in device_owners:
        if not 0 <= block < bm.device.num_blocks:
            _fail(f"device block {block} is out of range")
    check_pool(bm.device, device_owners, "device")
    check_pool(bm.host, host_owners, "host")
    ids = [s.seq_id for s in (*live, *sched.waiting, *sched.swapped)]
    if len(ids) != len(set(ids)):
        _fail(f"a sequence id is queued twice: {sorted(i for i in ids if ids.count(i) > 1)}")
