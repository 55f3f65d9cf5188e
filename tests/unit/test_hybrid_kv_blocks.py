"""A hybrid model's KV groups (protocol/kv_groups.py): global and local layers alternate, each
sequence holds a table per group, and the local tables free their blocks behind the window.

Each run drives the real scheduler against the simulated worker (tests/support/scheduler_sim.py),
which writes every group's table, reads each within its window, tags each local slot with its group
and fails on any slot that holds another sequence's (or another group's) KV or a stale value; the
debug invariants run after every call (blocks conserved, a block in one group at a time, freed
entries the null block, fresh blocks zeroed).
"""

from __future__ import annotations

import pytest

from pagedserve.protocol.codec import Decoder, encode
from pagedserve.protocol.kv_groups import kv_groups
from pagedserve.protocol.messages import AddRequest, SchedulerToWorker, GroupedSchedulerOutput, SamplingParams, SchedulerOutput
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc import prefix_cache
from pagedserve.scheduler_proc.admission import length_limit
from pagedserve.scheduler_proc.block_pool import BlockPool
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.invariants import InvariantError
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.scheduler_proc.sliding_window import max_live_blocks

from support.scheduler_sim import (SimWorker, StepDriver, assert_all_blocks_free, assert_null_block_untouched,
                                   tokens_by_request, counting_tokens, request,
                                   run_until_done, swap_one_back_in)

BLOCK, WINDOW = 4, 8
LIVE = max_live_blocks(WINDOW, BLOCK)  # 3


def config(**overrides) -> SchedulerConfig:
    values = dict(block_size=BLOCK, num_gpu_blocks=40, max_num_seqs=8, max_num_batched_tokens=32,
                  max_model_len=400, debug_invariants=True, num_window_groups=1, hybrid_window=WINDOW)
    values.update(overrides)
    return SchedulerConfig(**values)


def run(sched: Scheduler, msgs, ahead: bool = False, next_token=None, worker=None):
    """Every request to its end: the deltas, the most live blocks one running sequence held in a
    local table and in its global one, the most running at once, and the worker."""
    for msg in msgs:
        assert sched.add_request(msg) == []
    worker = worker or SimWorker(sched.config, next_token or counting_tokens())
    peak = {"local": 0, "global": 0, "running": 0, "steps": 0}

    def on_step(out, result, deltas):
        assert type(out) is (GroupedSchedulerOutput if sched.config.num_window_groups else SchedulerOutput)
        running = sched.running.in_order()
        peak["running"] = max(peak["running"], len(running))
        peak["steps"] += 1
        for seq in running:
            peak["global"] = max(peak["global"], len(seq.block_ids))
            for table in seq.window_tables:
                peak["local"] = max(peak["local"], len(table) - seq.num_window_freed)

    deltas = run_until_done(sched, worker, on_step=on_step, ahead=ahead)
    assert_all_blocks_free(sched)
    if sched.bm.num_window_groups:
        assert_null_block_untouched(sched, worker)
    return deltas, peak, worker


outputs = tokens_by_request  # the tests' short name


def test_groups_of_gemma2_gemma3_and_gpt_oss_layouts():
    gemma2 = kv_groups([4096, 0] * 3)  # local, global alternating (gpt-oss alike)
    assert (gemma2.group_size, gemma2.num_window_groups, gemma2.window) == (3, 1, 4096)
    assert gemma2.layer_slots == ((1, 0), (0, 0), (1, 1), (0, 1), (1, 2), (0, 2))
    gemma3 = kv_groups([512] * 5 + [0] + [512] * 5 + [0] + [512, 512])  # 12 local, 2 global: 6 local groups
    assert (gemma3.group_size, gemma3.num_window_groups) == (2, 6)
    assert sorted(gemma3.layer_slots) == sorted({(g, s) for g in range(7) for s in range(2)})
    odd = kv_groups([512] * 5 + [0] + [512] * 2 + [0])  # 7 local, 2 global: the last local group padded
    assert odd.num_window_groups == 4 and odd.layer_slots[-2] == (4, 0)
    for not_hybrid in ([0, 0], [8, 8], [], [8, 0, 0], [8, 16, 0, 0]):
        assert kv_groups(not_hybrid) is None, not_hybrid
    assert kv_groups([8, 16, 0, 8]) is None  # two windows: one table, every block kept


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("window", [WINDOW, BLOCK])  # a window of one block: 2 blocks (a prompt of 2)
def test_a_long_generation_holds_only_its_window_in_the_local_table(ahead, window):
    sched = Scheduler(config(hybrid_window=window))
    prompt = list(range(10, 10 + max_live_blocks(window, BLOCK) * BLOCK - 2))  # a prompt chunk holds its blocks
    deltas, peak, _ = run(sched, [request("long", prompt, max_tokens=120)], ahead)
    assert len(outputs(deltas)["long"]) == 120
    assert peak["global"] >= (len(prompt) + 118) // BLOCK  # the global table keeps every block
    assert peak["local"] <= max_live_blocks(window, BLOCK)
    assert sched.stats()["num_preemptions_recompute"] == 0


def test_a_lone_sequence_grows_to_the_length_limit_and_is_never_preempted_for_its_length():
    cfg = config(num_gpu_blocks=21)  # 20 usable: the global table 17, the local one its 3
    limit = length_limit(cfg)
    assert limit == (20 - LIVE) * BLOCK + 1
    sched = Scheduler(cfg)
    deltas, peak, _ = run(sched, [request("long", list(range(10, 20)), max_tokens=400)])
    assert len(outputs(deltas)["long"]) == limit - 10  # the whole cache, then "length"
    stats = sched.stats()
    assert stats["num_preemptions_recompute"] == stats["num_preemptions_swap"] == 0
    assert peak["local"] <= LIVE


def test_more_sequences_run_at_once_than_with_one_table_in_the_same_memory():
    """A block of one table spans both layer kinds, a hybrid block one group's: the same memory
    holds twice the blocks, and the local tables stay at their window."""
    msgs = [request(f"r{i}", [10 + i] * 6, max_tokens=30) for i in range(6)]  # 9 global blocks + 3 local
    hybrid = Scheduler(config(num_gpu_blocks=80))
    one_table = Scheduler(config(num_gpu_blocks=40, num_window_groups=0, hybrid_window=0))
    tokens_hybrid, peak_hybrid, _ = run(hybrid, msgs)
    tokens_one, peak_one, _ = run(one_table, [request(m.request_id, m.prompt_token_ids, max_tokens=30) for m in msgs])
    assert outputs(tokens_hybrid) == outputs(tokens_one)  # the simulated worker's tokens
    assert peak_hybrid["running"] == 6 and hybrid.stats()["num_preemptions_recompute"] == 0
    assert one_table.stats()["num_preemptions_recompute"] > 0
    assert peak_hybrid["steps"] < peak_one["steps"]


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("caching", [False, True])  # a swapped-in sequence's blocks are named again in every table
def test_preempted_sequences_come_back_with_every_table(groups, mode, ahead, caching):
    """Long low-priority sequences fill the cache; an urgent one preempts one of them, which comes
    back (by swap: the global table and the local tables' live blocks) and reads only its own KV."""
    sched = Scheduler(config(num_gpu_blocks=16 * (1 + groups), num_cpu_blocks=80, preemption_mode=mode,
                             scheduling_policy="priority", num_window_groups=groups, enable_prefix_caching=caching))
    for i in range(3):
        assert sched.add_request(AddRequest(f"low{i}", [20 + i] * 5, SamplingParams(max_tokens=30), priority=1,
                                            eos_token_ids=[])) == []
    worker = SimWorker(sched.config, counting_tokens())
    driver = StepDriver(sched, worker, ahead)
    deltas = []
    for step in range(400):
        if step == 20:
            assert sched.add_request(AddRequest("urgent", [9] * 6, SamplingParams(max_tokens=30),
                                                eos_token_ids=[])) == []
        if not driver.busy():
            break
        deltas += driver.step()[2]
    assert {k: len(v) for k, v in outputs(deltas).items()} == {"low0": 30, "low1": 30, "low2": 30, "urgent": 30}
    assert sched.stats()[f"num_preemptions_{mode}"] > 0
    if caching:  # prompts starting as theirs did hit only blocks that hold that KV (the worker checks)
        run(sched, [request(f"probe{i}", [20 + i] * 4 + [99], max_tokens=2) for i in range(3)], ahead, worker=worker)
    assert_all_blocks_free(sched)


def test_prefix_hits_take_every_global_block_and_only_the_window_of_the_local_ones():
    sched = Scheduler(config(num_gpu_blocks=60, enable_prefix_caching=True))
    prompt = list(range(30, 60))  # 7 full blocks before the last token
    deltas, _, worker = run(sched, [request("a", prompt, max_tokens=4)])
    assert outputs(deltas)["a"]
    seen = {}
    sched.add_request(request("b", prompt, max_tokens=4))
    out = sched.schedule()
    (new,) = out.new_requests
    seen["global"], seen["local"] = new.block_ids, out.window_block_ids["b"][0]
    assert new.num_computed_tokens == 7 * BLOCK
    behind = (7 * BLOCK - WINDOW) // BLOCK  # 5 blocks no query of b reads: never taken
    assert seen["local"][:behind] == [sched.bm.null_block] * behind
    assert sched.bm.null_block not in seen["global"]
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)  # the simulated worker reads every hit block within its window
    assert_all_blocks_free(sched)


def test_a_sequence_swapped_back_in_names_every_tables_blocks_again_so_later_prompts_hit_them():
    sched = Scheduler(config(num_gpu_blocks=17, num_cpu_blocks=16, max_num_seqs=4, preemption_mode="swap",
                             enable_prefix_caching=True, hybrid_window=64))  # the window keeps the first block
    worker = SimWorker(sched.config, counting_tokens())
    new = swap_one_back_in(sched, worker)
    sched.add_request(request("probe", list(new.token_ids[:4]) + [99], max_tokens=1))
    out = sched.schedule()
    [probe] = [r for r in out.new_requests if r.req_id == "probe"]
    assert probe.num_computed_tokens == 4 and probe.block_ids[0] == new.block_ids[0]
    assert out.window_block_ids["probe"][0][0] == new.window_tables[0][0]
    sched.update_from_output(out, worker.step(out))  # the simulated worker checks the hit's KV in both tables
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_a_local_group_missing_a_block_its_window_needs_shortens_the_hit():
    pool = BlockPool(16)
    keys = [prefix_cache.block_key(0, bytes([i]) * 8 * BLOCK) for i in range(4)]
    hits = [pool.take_fresh() for _ in keys]
    for block, key in zip(hits, keys):
        pool.register(block, key)
    local = {i: pool.take_fresh() for i in (1, 2)}
    for i, block in local.items():
        pool.register(block, prefix_cache.window_key(keys[i], 1))
    # 4 hits: the window (8 tokens) reaches blocks 2 and 3, and block 3's local KV is gone; 3 hits
    # need blocks 1 and 2 only
    assert prefix_cache.window_hits(pool, hits, keys, 1, WINDOW, BLOCK) == (3, ([local[1], local[2]],), 1)
    assert prefix_cache.window_hits(pool, hits, keys, 1, 4 * BLOCK, BLOCK) == (0, ([],), 0)  # all need block 0
    two = BlockPool(3)  # 2 hits, the local KV of the first only: a hit of 1 block
    a, b, local_a = (two.take_fresh() for _ in range(3))
    for block, key in ((a, keys[0]), (b, keys[1]), (local_a, prefix_cache.window_key(keys[0], 1))):
        two.register(block, key)
    assert prefix_cache.window_hits(two, [a, b], keys[:2], 1, WINDOW, BLOCK) == (1, ([local_a],), 0)


def test_forks_copy_every_table_and_speculation_trims_every_table():
    sched = Scheduler(config(enable_prefix_caching=True, num_gpu_blocks=80))
    deltas, _, worker = run(sched, [request("a", list(range(30, 49)), max_tokens=20, n=3)])
    assert len(outputs(deltas)["a"]) == 60
    spec = Scheduler(config(speculative=SpeculativeConfig("ngram", 3, 4, 1)))
    deltas, peak, _ = run(spec, [request("s", [5, 6, 7, 8] * 4, max_tokens=80)],
                          next_token=lambda req_id, tokens: tokens[-4] if len(tokens) % 23 else 9)
    assert len(outputs(deltas)["s"]) == 80
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert peak["local"] <= LIVE + 1  # a step's proposals may start a block


def test_the_invariants_catch_a_block_in_two_groups():
    sched = Scheduler(config())
    sched.add_request(request("a", list(range(10, 30)), max_tokens=4))
    worker = SimWorker(sched.config, counting_tokens())
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    (seq,) = sched.running.in_order()
    local = seq.window_tables[0]
    sched.bm.device.release(local[-1])
    local[-1] = seq.block_ids[-1]
    sched.bm.device.share(local[-1])
    with pytest.raises(InvariantError, match="in KV groups 0 and 1"):
        sched.check_invariants()


def test_a_grouped_step_round_trips_and_a_one_group_step_is_the_plain_message():
    sched = Scheduler(config())
    sched.add_request(request("a", list(range(10, 30)), max_tokens=4))
    out = sched.schedule()
    assert Decoder(SchedulerToWorker).decode(encode(out)) == out and len(out.window_block_ids["a"]) == 1
    plain = Scheduler(config(num_window_groups=0, hybrid_window=0))
    plain.add_request(request("a", list(range(10, 30)), max_tokens=4))
    assert type(plain.schedule()) is SchedulerOutput


def test_steady_decodes_of_a_hybrid_model_join_the_decode_lane_and_run_ahead():
    """The lane grants a block per table at a block's start (the local ones in ``window_block_ids``)."""
    sched = Scheduler(config())
    for i in range(3):
        assert sched.add_request(request(f"r{i}", [10 + i] * 5, max_tokens=40)) == []
    driver = StepDriver(sched, SimWorker(sched.config, counting_tokens()), ahead=True)
    most_steady, deltas = 0, []
    while driver.busy():
        out, _, step_deltas = driver.step()
        deltas += step_deltas
        most_steady = max(most_steady, sched.running.num_steady)
    assert most_steady == 3 and driver.steps_ahead > 0
    assert {k: len(v) for k, v in outputs(deltas).items()} == {"r0": 40, "r1": 40, "r2": 40}
    assert_all_blocks_free(sched)
