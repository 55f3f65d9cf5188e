"""The block pools and per-sequence block bookkeeping, on their own."""

from __future__ import annotations

import random

from pagedserve.protocol.messages import AddRequest, SamplingParams
from pagedserve.scheduler_proc.block_manager import BlockManager
from pagedserve.protocol.block_hash import block_key
from pagedserve.scheduler_proc.block_pool import BlockPool, CacheEventLog
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.request import Request, Sequence
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, assert_all_blocks_free, random_tokens, request, run_until_done


def sequence(tokens: int) -> Sequence:
    msg = AddRequest(request_id="s", prompt_token_ids=list(range(tokens)), sampling=SamplingParams())
    return Sequence("s", Request(msg, 1, 0, 10_000), 0, list(range(tokens)), msg.sampling, False)


def test_free_plus_used_is_always_the_total_and_a_freed_block_is_reusable():
    pool = BlockPool(4)
    taken = [pool.take_fresh() for _ in range(4)]
    assert pool.num_free == 0 and pool.num_used == 4 and sorted(taken) == [0, 1, 2, 3]
    pool.share(taken[0])
    assert not pool.release(taken[0]) and pool.release(taken[0])
    assert pool.num_free == 1 and pool.take_fresh() == taken[0]


def test_cached_blocks_are_evicted_least_recently_freed_first_and_only_when_no_plain_block_is_left():
    pool = BlockPool(3)  # a pool with no event log (only a scheduler's device pool reports to the router)
    a, b, c = (pool.take_fresh() for _ in range(3))
    ka, kb = (block_key(0, bytes([i]) * 32) for i in range(2))
    pool.register(a, ka)
    pool.register(b, kb)
    pool.release(b)
    pool.release(a)
    pool.release(c)
    assert pool.take_fresh() == c  # plain first
    assert pool.take_fresh() == b and pool.lookup(kb) is None  # then the oldest freed cached block
    assert pool.lookup(ka) == a
    pool.share(a)  # a hit revives it from the middle of the free list
    assert pool.num_free == 0


def test_the_cache_log_first_tells_the_router_to_forget_then_sends_each_change_once_in_numbered_batches():
    log = CacheEventLog()
    assert log.drain() == (0, True, [], [])  # the router may hold an earlier pool's blocks
    assert log.drain() is None
    pool = BlockPool(2)
    pool.events = log
    block = pool.take_fresh()
    key = block_key(0, bytes(32))
    pool.register(block, key)
    assert log.drain() == (1, False, [key[2]], [])
    pool.release(block)
    pool.take_fresh()
    pool.take_fresh()  # evicts the cached block
    assert log.drain() == (2, False, [], [key[2]])


def test_the_cache_log_holds_up_to_its_bound_of_changes_and_past_it_asks_the_router_to_forget():
    log = CacheEventLog()
    log.drain()
    bound = CacheEventLog.MAX_PENDING
    for h in range(bound):
        log.note_removed(h)
    assert log.drain() == (1, False, [], list(range(bound)))
    for h in range(bound + 1):  # nobody drained: the log keeps nothing rather than grow
        log.note_removed(h)
    assert log.drain() == (2, True, [], [])


def test_check_then_commit_appends_only_what_was_promised_and_lists_each_fresh_block_once():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=3))
    seq = sequence(6)
    assert bm.can_allocate([], 2)
    bm.allocate(seq, [], 2)
    seq.num_kv_tokens = 6
    assert bm.can_append_slots(seq, 2) and not bm.can_append_slots(seq, 7)
    bm.append_slots(seq, 2)
    assert len(seq.block_ids) == 2
    bm.append_slots(seq, 3)
    assert len(seq.block_ids) == 3
    zero, copies = bm.drain()
    assert sorted(zero) == sorted(seq.block_ids) and copies == []
    assert bm.drain() == ([], [])


def test_a_decodes_proposals_fit_only_in_the_blocks_beyond_its_own_token_and_those_left_for_later_sequences():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=5))
    seq = sequence(4)
    bm.allocate(seq, [], 1)
    seq.num_kv_tokens = 4  # its next token starts a block: 1 of the 4 free blocks is its own
    # 4 free: 1 for the token (room for 3 proposals after it), 1 left for a later sequence, 2 spare
    assert bm.num_extra_fitting(seq, 1, 12, blocks_to_leave=1) == 3 + 2 * 4
    assert bm.num_extra_fitting(seq, 1, 5, blocks_to_leave=1) == 5
    assert bm.num_extra_fitting(seq, 1, 8, blocks_to_leave=3) == 3  # only the token's own block's room
    assert bm.num_extra_fitting(seq, 1, 8, blocks_to_leave=4) == 0
    assert bm.device.num_free == 4 and len(seq.block_ids) == 1  # a question: nothing taken


def test_a_block_freed_before_the_step_is_built_is_not_listed_and_is_listed_once_when_reused():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=2))
    seq = sequence(4)
    bm.allocate(seq, [], 1)
    [block] = seq.block_ids
    bm.free(seq)
    other = sequence(4)
    bm.allocate(other, [], 2)
    zero, _ = bm.drain()
    assert sorted(zero) == sorted(other.block_ids) and zero.count(block) == 1


def test_swap_out_and_in_move_every_block_and_return_the_host_blocks():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=4, num_cpu_blocks=4))
    seq = sequence(8)
    bm.allocate(seq, [], 2)
    seq.num_kv_tokens = 8
    device_blocks = list(seq.block_ids)
    assert bm.can_swap_out(seq)
    out = bm.swap_out(seq)
    assert [d for d, _ in out] == device_blocks and bm.device.num_free == 4 and bm.host.num_free == 2
    assert bm.can_swap_in(seq, 1)
    back = bm.swap_in(seq)
    assert [h for h, _ in back] == [h for _, h in out] and bm.host.num_free == 4
    assert seq.block_ids == [d for _, d in back]


def test_swapping_fits_exactly_when_the_free_blocks_equal_the_table():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=2, num_cpu_blocks=2))
    seq = sequence(8)
    bm.allocate(seq, [], 2)
    seq.num_kv_tokens = 7
    assert bm.can_swap_out(seq)  # 2 blocks into 2 free host blocks
    bm.swap_out(seq)
    assert bm.can_swap_in(seq, 1) and not bm.can_swap_in(seq, 2)  # 8 tokens fill the 2 device blocks


def forked_pair(num_gpu_blocks: int, computed: int) -> tuple[BlockManager, Sequence, Sequence]:
    """Two samples forked from a parent that computed ``computed`` prompt tokens (blocks of 4)."""
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=num_gpu_blocks))
    parent = sequence(computed + 1)
    bm.allocate(parent, [], bm.blocks_for(computed))
    parent.num_kv_tokens = computed
    children = [sequence(computed + 1) for _ in range(2)]
    for child in children:
        child.num_kv_tokens = computed
    bm.fork(parent, children)
    return bm, children[0], children[1]


def test_a_sample_writing_into_a_shared_partial_tail_block_needs_a_block_for_its_copy():
    bm, a, b = forked_pair(num_gpu_blocks=5, computed=5)  # 2 shared blocks, the tail holds 1 token
    assert bm.device.num_free == 3
    assert bm.num_new_blocks(a, 1) == 1 and bm.num_new_blocks(a, 4) == 2
    assert bm.max_appendable_tokens(a) == 3 + 2 * 4  # the copy takes one of the 3 free blocks
    assert bm.can_append_slots(a, 3 + 2 * 4) and not bm.can_append_slots(a, 4 + 2 * 4)
    bm.append_slots(a, 1)
    assert a.shared_tail is False and a.block_ids[-1] != b.block_ids[-1]  # its own copy
    # the sibling is now the tail's only owner: it writes in place, no copy
    assert bm.num_new_blocks(b, 1) == 0 and bm.max_appendable_tokens(b) == 3 + 2 * 4


def test_a_shared_tail_copy_that_takes_the_last_free_block_leaves_room_only_in_the_copy():
    bm, a, _ = forked_pair(num_gpu_blocks=3, computed=5)
    assert bm.device.num_free == 1 and bm.max_appendable_tokens(a) == 3
    bm.device.take_fresh()
    assert bm.max_appendable_tokens(a) == 0 and not bm.can_append_slots(a, 1)


def test_samples_forked_at_a_block_boundary_share_only_full_blocks_and_copy_nothing():
    bm, a, _ = forked_pair(num_gpu_blocks=4, computed=8)
    assert bm.num_new_blocks(a, 1) == 1 and bm.max_appendable_tokens(a) == 2 * 4


def test_cached_free_blocks_a_prompt_hits_leave_the_free_pool_when_it_is_admitted():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=4))
    seq = sequence(8)
    bm.allocate(seq, [], 2)
    for i, block in enumerate(seq.block_ids):
        bm.device.register(block, ("key", i))
    hits = list(seq.block_ids)
    bm.free(seq)
    assert bm.device.num_free == 4  # cached but free: evictable
    assert bm.can_allocate(hits, 4) and not bm.can_allocate(hits, 5)
    holder = sequence(8)
    bm.allocate(holder, hits, 2)  # in use now: a second hit costs no free block
    assert bm.can_allocate(hits, 2 + 2) and not bm.can_allocate(hits, 2 + 3)


def test_freeing_or_trimming_blocks_before_the_step_is_built_drops_their_pending_zeroing():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=4))
    seq = sequence(8)
    bm.allocate(seq, [], 0)
    bm.append_slots(seq, 8)
    bm.free(seq)
    assert bm.drain() == ([], [])
    other = sequence(8)
    bm.allocate(other, [], 0)
    other.num_kv_tokens = 3
    bm.append_slots(other, 6)  # three blocks granted; the step is then abandoned with 3 computed
    bm.release_unused(other)
    zero, _ = bm.drain()
    assert zero == other.block_ids and len(zero) == 1


def test_after_every_request_finishes_every_ref_count_is_zero_and_the_free_list_holds_every_block():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=12, max_num_seqs=6,
                             max_num_batched_tokens=24, enable_prefix_caching=True, debug_invariants=True)
    sched = Scheduler(config)
    rng = random.Random(5)
    worker = SimWorker(config, random_tokens(rng, 0.05))
    for i in range(30):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(0, 8)] + [rng.randrange(10, 90) for _ in range(rng.randint(1, 12))]
        sched.add_request(request(f"r{i}", prompt, max_tokens=rng.randint(1, 20), n=rng.choice([1, 1, 2])))
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)
    device = sched.bm.device
    assert sorted([*device.plain_free, *device.evictable]) == list(range(24))
    assert sorted(sched.bm.host.plain_free) == list(range(12))


def test_a_sequence_ended_while_swapped_out_gives_back_its_host_blocks():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=4, num_cpu_blocks=4))
    seq = sequence(8)
    bm.allocate(seq, [], 2)
    seq.num_kv_tokens = 8
    bm.swap_out(seq)
    assert bm.host.num_free == 2
    bm.free(seq)  # aborted, or past its deadline, before it came back
    assert bm.host.num_free == 4 and bm.device.num_free == 4 and seq.host_block_ids == []


def test_a_sample_ended_before_its_step_is_built_sends_no_copy_of_its_shared_tail():
    bm, a, b = forked_pair(num_gpu_blocks=5, computed=5)
    bm.drain()  # the parent's step
    bm.append_slots(a, 1)  # a copy of the shared tail is listed for this step
    bm.free(a)  # then a ends (an abort) before the step's output is built
    assert bm.drain() == ([], [])
    assert bm.device.num_free == 3 and bm.num_new_blocks(b, 1) == 0  # b owns the tail alone again


# ------------------------------------------------------------------ windows and KV groups (blocks of 4, a window of 8)


def windowed(**fields) -> BlockManager:
    """Every layer windowed (``sliding_window``), or a hybrid model's one local group beside the global one."""
    return BlockManager(SchedulerConfig(block_size=4, **{"sliding_window": 8, **fields}))


def hybrid(**fields) -> BlockManager:
    return windowed(sliding_window=0, num_window_groups=1, hybrid_window=8, **fields)


def computed(bm: BlockManager, tokens: int) -> Sequence:
    """A sequence whose ``tokens`` computed tokens fill fresh blocks."""
    seq = sequence(tokens)
    bm.allocate(seq, [], bm.blocks_for(tokens))
    seq.num_kv_tokens = tokens
    return seq


def test_blocks_wholly_behind_the_window_go_back_to_the_pool_counted_and_never_zeroed():
    bm = windowed(num_gpu_blocks=10, num_cpu_blocks=2)  # one block is the null block
    seq = computed(bm, 24)
    assert bm.device.num_free == 3
    assert bm.release_behind_window(seq, 24) == 4  # a query at 24 reads 17..24: blocks 4 and 5
    assert bm.device.num_free == 7 and seq.block_ids[:4] == [bm.null_block] * 4 and seq.num_freed_blocks == 4
    assert bm.drain()[0] == seq.block_ids[4:]  # freed before the step that would write them: not zeroed
    assert bm.release_behind_window(seq, 27) == 0 and bm.device.num_free == 7  # nothing more behind yet
    assert bm.release_behind_window(seq, 28) == 1 and bm.device.num_free == 8
    assert bm.can_swap_out(seq)  # its one live block fits the host
    bm.host.take_fresh()
    bm.host.take_fresh()
    assert not bm.can_swap_out(seq)


def test_without_a_window_releasing_behind_it_frees_nothing():
    bm = BlockManager(SchedulerConfig(block_size=4, num_gpu_blocks=8))
    seq = computed(bm, 24)
    assert bm.release_behind_window(seq, 24) == 0 and bm.device.num_free == 2 and bm.null_block not in seq.block_ids


def test_a_block_a_sibling_still_reads_stays_and_is_counted_free_only_when_the_last_sibling_lets_go():
    bm = windowed(num_gpu_blocks=10)
    parent = computed(bm, 24)
    a, b = sequence(25), sequence(25)
    a.num_kv_tokens = b.num_kv_tokens = 24
    bm.fork(parent, [a, b])
    assert bm.release_behind_window(a, 24) == 0 and bm.device.num_free == 3
    assert a.block_ids[:4] == [bm.null_block] * 4 and bm.null_block not in b.block_ids
    assert bm.release_behind_window(b, 24) == 4 and bm.device.num_free == 7


def test_a_hybrid_sequences_local_table_frees_behind_its_window_and_the_global_table_keeps_every_block():
    bm = hybrid(num_gpu_blocks=20)
    seq = computed(bm, 24)
    [local] = seq.window_tables
    assert len(local) == len(seq.block_ids) == 6 and bm.null_block not in local + seq.block_ids
    assert bm.device.num_free == 19 - 12
    assert bm.release_behind_window(seq, 24) == 4 and bm.device.num_free == 11
    assert local[:4] == [bm.null_block] * 4 and seq.num_window_freed == 4 and bm.null_block not in seq.block_ids
    assert bm.drain()[0] == seq.block_ids + local[4:]  # the freed local blocks were never written: not zeroed
    assert bm.release_behind_window(seq, 27) == 0 and bm.device.num_free == 11


def test_a_hybrid_sequence_swaps_its_global_blocks_and_its_live_local_ones_and_comes_back_when_they_fit():
    bm = hybrid(num_gpu_blocks=20, num_cpu_blocks=8)
    seq = computed(bm, 24)
    bm.release_behind_window(seq, 24)  # 6 global blocks and 2 local ones live
    assert bm.can_swap_out(seq)
    spare = bm.host.take_fresh()
    assert not bm.can_swap_out(seq)
    bm.host.release(spare)
    assert len(bm.swap_out(seq)) == 8 and bm.host.num_free == 0 and bm.device.num_free == 19
    held = [bm.device.take_fresh() for _ in range(8)]
    room = bm.swap_in_room(seq)  # 11 free: the most tokens it could compute on coming back
    assert room > 0 and bm.can_swap_in(seq, room) and not bm.can_swap_in(seq, room + 1)
    held.append(bm.device.take_fresh())  # 10 free: 7 global blocks and 3 local ones for one more token
    assert bm.can_swap_in(seq, 1)
    held.append(bm.device.take_fresh())
    assert not bm.can_swap_in(seq, 1)
    for block in held:
        bm.device.release(block)
    assert len(bm.swap_in(seq)) == 8 and bm.host.num_free == 8
    assert seq.window_tables[0][:4] == [bm.null_block] * 4 and len(seq.window_tables[0]) == len(seq.block_ids) == 6
    bm.swap_out(seq)
    bm.free(seq)  # ended while swapped out: every table's host blocks come back
    assert bm.host.num_free == 8 and bm.device.num_free == 19
