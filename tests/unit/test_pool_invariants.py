"""The block pool's invariant check (scheduler_proc/invariants.py) catches each way a pool can
contradict its owners, and passes a consistent one, empty or of a demo model's host size."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedserve.scheduler_proc.block_pool import BlockPool
from pagedserve.scheduler_proc.invariants import InvariantError, check_pool


def _pool_with_one_owned(num_blocks: int = 8) -> tuple[BlockPool, int]:
    pool = BlockPool(num_blocks)
    return pool, pool.take_fresh()


def _broken(kind: str) -> tuple[BlockPool, Counter]:
    pool, block = _pool_with_one_owned()
    owners = Counter({block: 1})
    if kind == "unowned count":
        owners = Counter()
    elif kind == "count too low":
        owners = Counter({block: 2})
    elif kind == "owned but free":
        owners[5] = 1
    elif kind == "free twice":
        pool.plain_free.append(3)
    elif kind == "plain and evictable":
        pool.evictable[3] = None
    elif kind == "lost block":
        pool.plain_free.remove(4)
    elif kind == "owned block freed":
        pool.plain_free.append(block)
    elif kind == "owner out of range":
        owners[9] = 1
    elif kind == "negative count":
        pool.ref_counts[6] = -1
        pool.plain_free.remove(6)
    return pool, owners


@pytest.mark.parametrize("kind, message", [
    ("unowned count", "block 0 has ref count 1 but 0 tables hold it"),
    ("count too low", "block 0 has ref count 1 but 2 tables hold it"),
    ("owned but free", "block 5 has ref count 0 but 1 tables hold it"),
    ("free twice", "a block is twice in the free list"),
    ("plain and evictable", "blocks [3] are both plain-free and evictable"),
    ("lost block", "block 4 with ref count 0 is not free"),
    ("owned block freed", "block 0 with ref count 1 is free"),
    ("owner out of range", "a table holds a block out of range"),
    ("negative count", "block 6 has ref count -1 but 0 tables hold it"),
])
def test_each_contradiction_is_named(kind, message):
    pool, owners = _broken(kind)
    with pytest.raises(InvariantError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_pool(pool, owners, "device")


def test_a_consistent_pool_passes_empty_or_large():
    check_pool(BlockPool(0), Counter(), "host")
    pool = BlockPool(500_000)  # a demo model's host pool: a GiB of swap in tiny blocks
    taken = [pool.take_fresh() for _ in range(100)]
    pool.share(taken[0])
    check_pool(pool, Counter(taken) + Counter([taken[0]]), "host")


def _run_with_debug_invariants(**overrides) -> None:
    from pagedserve.scheduler_proc.config import SchedulerConfig
    from pagedserve.scheduler_proc.scheduler import Scheduler
    from support.scheduler_sim import SimWorker, counting_tokens, request, run_until_done

    config = SchedulerConfig(debug_invariants=True, block_size=4, num_gpu_blocks=32, **overrides)
    sched = Scheduler(config)
    for i in range(3):
        sched.add_request(request(f"r{i}", list(range(10, 19 + i)), max_tokens=6, ignore_eos=True))
    run_until_done(sched, SimWorker(config, counting_tokens()))


def test_the_debug_check_catches_a_fresh_block_handed_out_without_zeroing(monkeypatch):
    """The stale-KV bug the block manager is built against: the check sees it in the step that
    hands the block out, before any worker reads it."""
    from pagedserve.scheduler_proc.block_manager import BlockManager

    monkeypatch.setattr(BlockManager, "take_blocks_to_write",
                        lambda self, count: [self.device.take_fresh() for _ in range(count)])
    with pytest.raises(InvariantError, match="with neither zeroing, a copy nor a swap-in"):
        _run_with_debug_invariants()


def test_the_debug_check_catches_a_request_left_open_with_no_sequence(monkeypatch):
    """A request whose samples all left the queues but that never closed keeps the engine stepping
    and its client waiting: the check names it."""
    from pagedserve.scheduler_proc.scheduler import Scheduler

    def retire_without_closing(self, seq):
        self._forget(seq)

    monkeypatch.setattr(Scheduler, "_retire", retire_without_closing)
    with pytest.raises(InvariantError, match=r"samples \[0\] are unfinished but in no queue"):
        _run_with_debug_invariants()
