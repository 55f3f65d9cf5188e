"""A full consistency check of the scheduler, its block pools and its LoRA slots, for debug runs and tests.

O(blocks + tokens): run it after every step only with ``debug_invariants``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

import numpy as np

from pagedserve.scheduler_proc.block_pool import BlockPool
from pagedserve.scheduler_proc.request import RUNNING, SWAPPED, WAITING

if TYPE_CHECKING:
    from pagedserve.protocol.messages import SchedulerOutput
    from pagedserve.scheduler_proc.scheduler import Scheduler


class InvariantError(AssertionError):
    """The scheduler's state contradicts itself; the message names what and where."""


def _fail(message: str) -> None:
    raise InvariantError(message)


def check_pool(pool: BlockPool, owners: Counter, name: str) -> None:
    """Every block is free (count 0) or owned with a count equal to the tables holding it.

    Vectorised over the pool: a host pool of a small model has hundreds of thousands of blocks,
    and a loop over them in Python made every debug step ~40x slower than the step itself."""
    n = pool.num_blocks
    refs = np.frombuffer(pool.ref_counts, dtype=np.int64) if n else np.zeros(0, np.int64)
    plain = np.frombuffer(pool.plain_free, dtype=np.int64) if len(pool.plain_free) else np.zeros(0, np.int64)
    evictable = np.fromiter(pool.evictable, dtype=np.int64, count=len(pool.evictable))
    for what, ids in (("free-list entry", plain), ("evictable block", evictable)):
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            _fail(f"{name}: a {what} is out of range")
    free = np.zeros(n, dtype=bool)
    free[plain] = True
    if np.count_nonzero(free) != plain.size:
        _fail(f"{name}: a block is twice in the free list")
    both = evictable[free[evictable]]
    if both.size:
        _fail(f"{name}: blocks {sorted(both.tolist())} are both plain-free and evictable")
    free[evictable] = True
    held = np.fromiter(owners.keys(), dtype=np.int64, count=len(owners))
    if held.size and (held.min() < 0 or held.max() >= n):
        _fail(f"{name}: a table holds a block out of range")
    counts = np.fromiter(owners.values(), dtype=np.int64, count=len(owners))
    bad = held[refs[held] != counts]
    used = np.flatnonzero(refs)
    if not bad.size and used.size != held.size:  # counts on blocks that no table holds
        bad = np.setdiff1d(used, held)
    if bad.size:
        block = int(bad[0])
        _fail(f"{name}: block {block} has ref count {refs[block]} but {owners.get(block, 0)} tables hold it")
    wrong = np.flatnonzero((refs == 0) != free)
    if wrong.size:
        block = int(wrong[0])
        _fail(f"{name}: block {block} with ref count {refs[block]} is {'' if free[block] else 'not '}free")
    if plain.size + evictable.size + used.size != n:
        _fail(f"{name}: free {plain.size + evictable.size} + used != total {n}")
    for block in pool.evictable:
        if pool.block_key[block] is None:
            _fail(f"{name}: evictable block {block} has no prefix-cache key")
    for key, block in pool.cache.items():
        if pool.block_key[block] != key:
            _fail(f"{name}: cache entry for block {block} does not match the block's key")
    if len(pool.block_key) - pool.block_key.count(None) != len(pool.cache):
        _fail(f"{name}: {len(pool.cache)} cache entries but a different number of named blocks")


def check(sched: "Scheduler", out: Optional["SchedulerOutput"] = None) -> None:
    """``out``: the step just built; its cache operations are checked against the tables too."""
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
            num_freed = seq.num_freed_blocks
            if num_freed and (not bm.window or status == WAITING or (
                    status == RUNNING and seq.block_ids[:num_freed] != [bm.null_block] * num_freed)):
                _fail(f"{status} {seq.seq_id}: its {num_freed} blocks freed behind the window are not the null block")
            if num_freed > bm.window_blocks_behind(seq):
                _fail(f"{seq.seq_id}: {num_freed} blocks freed, but its window reaches into them")
            device_owners.update(seq.block_ids[num_freed:])
            host_owners.update(seq.host_block_ids)
            if bm.num_window_groups:
                _check_window_tables(bm, seq, status, device_owners, host_owners)
            elif seq.window_tables or seq.window_host_tables or seq.num_window_freed:
                _fail(f"{seq.seq_id} holds local tables, but the model has one KV group")
            expected = bm.blocks_for(seq.num_kv_tokens)
            if status == RUNNING and len(seq.block_ids) != expected:
                _fail(f"{seq.seq_id}: {len(seq.block_ids)} blocks for {seq.num_kv_tokens} computed tokens")
            if status == WAITING and (seq.block_ids or seq.host_block_ids or seq.num_kv_tokens):
                _fail(f"waiting {seq.seq_id} holds blocks or computed tokens")
            if status == SWAPPED and (seq.block_ids or len(seq.host_block_ids) != expected - num_freed):
                _fail(f"swapped {seq.seq_id}: device {seq.block_ids}, host {seq.host_block_ids}")
            if len(seq.block_keys) > seq.num_kv_tokens // bm.block_size:
                _fail(f"{seq.seq_id} names more blocks than it has computed")
    for block in device_owners:
        if not 0 <= block < bm.device.num_blocks:
            _fail(f"device block {block} is out of range")
    if bm.num_window_groups:
        _check_groups_disjoint(bm, [*live, *sched.swapped])
    if bm.frees_behind_window:  # the null block: owned by the manager alone, never in a table's live part
        if device_owners[bm.null_block]:
            _fail(f"the null block {bm.null_block} is in a table as a live block")
        device_owners[bm.null_block] = 1
    check_pool(bm.device, device_owners, "device")
    check_pool(bm.host, host_owners, "host")
    ids = [s.seq_id for s in (*live, *sched.waiting, *sched.swapped)]
    if len(ids) != len(set(ids)):
        _fail(f"a sequence id is queued twice: {sorted(i for i in ids if ids.count(i) > 1)}")
    _check_requests(sched, set(ids))
    if sched.lora is not None:  # slot references = admitted sequences per adapter; running ones' adapters in a slot
        sched.lora.check([*live, *sched.swapped], live, sched.waiting, _fail)
    _check_fresh_blocks(sched, live, out)


def _check_window_tables(bm, seq, status: str, device_owners: Counter, host_owners: Counter) -> None:
    """A hybrid model's local tables (block_manager.py): as long as the global one, their freed
    entries the null block and behind the window, their live blocks counted as owned."""
    groups, freed, tables = bm.num_window_groups, seq.num_window_freed, seq.window_tables
    if status == RUNNING:
        if len(tables) != groups or any(len(table) != len(seq.block_ids) for table in tables):
            _fail(f"{seq.seq_id}: local tables of {[len(t) for t in tables]} entries for {groups} groups, "
                  f"the global table has {len(seq.block_ids)}")
        if any(table[:freed] != [bm.null_block] * freed for table in tables):
            _fail(f"{seq.seq_id}: its {freed} local entries freed behind the window are not the null block")
        if freed > bm.window_tables_behind(seq):
            _fail(f"{seq.seq_id}: {freed} local entries freed, but the local window reaches into them")
    elif tables:
        _fail(f"{status} {seq.seq_id} holds local tables on the device")
    if status == WAITING and (seq.window_host_tables or freed):
        _fail(f"waiting {seq.seq_id} holds local blocks")
    if status == SWAPPED:
        expected = bm.blocks_for(seq.num_kv_tokens) - freed
        if len(seq.window_host_tables) != groups or any(len(t) != expected for t in seq.window_host_tables):
            _fail(f"swapped {seq.seq_id}: local host tables {seq.window_host_tables}, {expected} live entries each")
    for table in tables:
        device_owners.update(table[freed:])
    for table in seq.window_host_tables:
        host_owners.update(table)


def _check_groups_disjoint(bm, seqs: list) -> None:
    """A block id is one page in each layer slot, so it belongs to one group at a time: no block is
    in two groups' tables, and a cached one is named with its group's key (prefix_cache.window_key)."""
    owner: dict[int, int] = {}
    keys = bm.device.block_key
    for seq in seqs:
        tables = [seq.block_ids[seq.num_freed_blocks:]] + [t[seq.num_window_freed:] for t in seq.window_tables]
        for group, table in enumerate(tables):
            for block in table:
                if owner.setdefault(block, group) != group:
                    _fail(f"block {block} is in KV groups {owner[block]} and {group} at once ({seq.seq_id})")
                key = keys[block]
                key_group = 0 if key is None or len(key) == 3 else key[3]
                if key is not None and key_group != group:
                    _fail(f"block {block} of KV group {group} is cached under group {key_group}'s key")


def _check_requests(sched: "Scheduler", queued: set[str]) -> None:
    """Each registered request's unfinished samples are queued (a parent, until it forks, stands
    for all of them): one that is not would keep the engine stepping and its client waiting."""
    for request_id, request in sched.requests.items():
        if not request.unfinished_indices:
            _fail(f"request {request_id} is registered with every sample finished")
        covered: set[int] = set()
        for seq in request.sequences:
            if seq.seq_id in queued:
                covered |= set(range(request.sampling.n)) if seq.is_parent else {seq.index}
        missing = request.unfinished_indices - covered
        if missing:
            _fail(f"request {request_id}: samples {sorted(missing)} are unfinished but in no queue")


def _check_fresh_blocks(sched: "Scheduler", live: list, out: Optional["SchedulerOutput"]) -> None:
    """A block a table gained since the last check holds what it should: it was zeroed, copied or
    swapped into this step, or it already held keys and values (a prefix hit, a fork). Zeroing
    runs after copies and swaps on the worker, so no block may be in both lists."""
    pairs = {(s.seq_id, b) for s in live for b in s.block_ids[s.num_freed_blocks:]}
    pairs |= {(s.seq_id, b) for s in live for table in s.window_tables for b in table[s.num_window_freed:]}
    held = {b for _, b in pairs} | set(sched.bm.device.evictable)
    old_pairs, old_held = sched._invariant_blocks
    sched._invariant_blocks = (pairs, held)
    if out is None:
        return
    zero = set(out.new_block_ids_to_zero)
    filled = {dst for _, dst in out.blocks_to_copy} | {dst for _, dst in out.blocks_to_swap_in}
    if zero & filled:
        _fail(f"blocks {sorted(zero & filled)} are both zeroed and filled in one step (zeroing runs last)")
    unowned = zero - held
    if unowned:
        _fail(f"blocks {sorted(unowned)} are to be zeroed but no table holds them")
    for seq_id, block in sorted(pairs - old_pairs):
        if block not in zero and block not in filled and block not in old_held:
            _fail(f"{seq_id} was given block {block} with neither zeroing, a copy nor a swap-in")
