"""Blocks behind a sliding window go back to the pool (scheduler_proc/sliding_window.py).

Each run drives the real scheduler against the simulated worker (tests/support/scheduler_sim.py),
which reads, for every query, the slots from its window's first position on and fails on any that
holds another sequence's KV; the debug invariants run after every call, so block conservation
(ref counts = tables, the null block held by the manager alone) is checked at every step.
"""

from __future__ import annotations

import pytest

from pagedserve.protocol.messages import AddRequest, SamplingParams
from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.scheduler_proc.invariants import InvariantError
from pagedserve.scheduler_proc.sliding_window import blocks_behind, max_live_blocks, window_to_free

from support.scheduler_sim import (SimWorker, StepDriver, assert_all_blocks_free, assert_null_block_untouched,
                                   tokens_by_request, counting_tokens, request,
                                   run_until_done)

BLOCK, WINDOW = 4, 8


def config(**overrides) -> SchedulerConfig:
    values = dict(block_size=BLOCK, num_gpu_blocks=12, max_num_seqs=8, max_num_batched_tokens=32,
                  max_model_len=400, debug_invariants=True, sliding_window=WINDOW)
    values.update(overrides)
    return SchedulerConfig(**values)


def run(sched: Scheduler, msgs, ahead: bool = False, next_token=None, worker=None):
    """Every request to its end; the most blocks one running sequence held and the most
    sequences running at once, over every step."""
    for msg in msgs:
        assert sched.add_request(msg) == []
    worker = worker or SimWorker(sched.config, next_token or counting_tokens())
    peak = {"blocks": 0, "running": 0, "steps": 0}

    def on_step(out, result, deltas):
        live = sched.running.check(AssertionError)
        running = live[0] + live[1]
        peak["running"] = max(peak["running"], len(running))
        peak["steps"] += 1
        for seq in running:
            peak["blocks"] = max(peak["blocks"], len(seq.block_ids) - seq.num_freed_blocks)

    deltas = run_until_done(sched, worker, on_step=on_step, ahead=ahead)
    assert_all_blocks_free(sched)
    if sched.bm.window:
        assert_null_block_untouched(sched, worker)
    return deltas, peak, worker


outputs = tokens_by_request  # the tests' short name


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("window, live", [(WINDOW, 3), (BLOCK, 2)])  # a window of one block: 2 (a prompt of 2)
def test_a_generation_longer_than_the_cache_holds_a_bounded_number_of_blocks(ahead, window, live):
    sched = Scheduler(config(sliding_window=window))  # 11 usable blocks: 44 tokens, the sequence reaches 310
    prompt = list(range(10, 10 + live * BLOCK - 2))  # a prompt chunk holds its own blocks for its step
    deltas, peak, _ = run(sched, [request("long", prompt, max_tokens=300)], ahead)
    assert len(outputs(deltas)["long"]) == 300
    assert peak["blocks"] <= max_live_blocks(window, BLOCK) == live
    assert sched.stats()["num_preemptions_recompute"] == 0


@pytest.mark.parametrize("window, live", [(WINDOW, 3), (BLOCK, 2)])
def test_a_per_object_sequence_frees_behind_its_window_as_soon_as_a_steady_decode_does(window, live):
    sched = Scheduler(config(sliding_window=window))
    prompt = list(range(10, 10 + live * BLOCK - 2))
    deltas, peak, _ = run(sched, [request("long", prompt, max_tokens=60, logprobs=1)])  # logprobs: per object
    assert len(outputs(deltas)["long"]) == 60
    assert peak["blocks"] == max_live_blocks(window, BLOCK) == live


def test_without_the_window_the_same_request_is_cut_at_the_cache():
    sched = Scheduler(config(sliding_window=0))
    deltas, _, _ = run(sched, [request("long", list(range(10, 20)), max_tokens=300)])
    assert len(outputs(deltas)["long"]) == 12 * BLOCK + 1 - 10  # the whole cache, then "length"


def test_more_sequences_run_at_once_with_the_same_cache():
    msgs = [request(f"r{i}", [10 + i] * 6, max_tokens=60) for i in range(6)]
    freed = Scheduler(config(num_gpu_blocks=40))
    kept = Scheduler(config(num_gpu_blocks=40, sliding_window=0))
    tokens_freed, peak_freed, _ = run(freed, [m for m in msgs])
    tokens_kept, peak_kept, _ = run(kept, [request(m.request_id, m.prompt_token_ids, max_tokens=60) for m in msgs])
    assert outputs(tokens_freed) == outputs(tokens_kept)  # the simulated worker's tokens
    assert peak_freed["running"] == 6 and freed.stats()["num_preemptions_recompute"] == 0
    assert kept.stats()["num_preemptions_recompute"] > 0  # 6 x 17 blocks do not fit 40: they take turns
    assert peak_freed["steps"] < peak_kept["steps"]


def test_a_prompt_longer_than_the_cache_is_computed_in_chunks_that_fit():
    sched = Scheduler(config(max_num_batched_tokens=64))
    deltas, peak, _ = run(sched, [request("p", list(range(100, 200)), max_tokens=5)])
    assert len(outputs(deltas)["p"]) == 5
    assert peak["blocks"] <= 11


def test_admission_leaves_room_for_each_sequence_to_reach_its_window_so_none_is_preempted():
    sched = Scheduler(config(num_gpu_blocks=9))  # 8 usable: room for two sequences of 3 blocks
    deltas, peak, _ = run(sched, [request(f"r{i}", [20 + i] * 2, max_tokens=60) for i in range(4)])
    assert all(len(t) == 60 for t in outputs(deltas).values())
    assert peak["running"] == 2 and sched.stats()["num_preemptions_recompute"] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("caching", [False, True])  # a swapped-in sequence's live blocks are named again
def test_preempted_sequences_come_back_with_their_window(mode, ahead, caching):
    """Long low-priority sequences fill the cache; an urgent one arriving later preempts one of them,
    which comes back (by swap: its live blocks only) and still reads only its own window."""
    sched = Scheduler(config(num_gpu_blocks=10, num_cpu_blocks=16, preemption_mode=mode, scheduling_policy="priority",
                             enable_prefix_caching=caching))
    for i in range(3):
        assert sched.add_request(AddRequest(f"low{i}", [20 + i] * 5, SamplingParams(max_tokens=60), priority=1,
                                            eos_token_ids=[])) == []
    worker = SimWorker(sched.config, counting_tokens())
    driver = StepDriver(sched, worker, ahead)
    deltas = []
    for step in range(400):
        if step == 30:
            assert sched.add_request(AddRequest("urgent", [9] * 6, SamplingParams(max_tokens=30),
                                                eos_token_ids=[])) == []
        if not driver.busy():
            break
        deltas += driver.step()[2]
    assert {k: len(v) for k, v in outputs(deltas).items()} == {"low0": 60, "low1": 60, "low2": 60, "urgent": 30}
    stats = sched.stats()
    assert stats[f"num_preemptions_{mode}"] > 0
    if mode == "swap":  # only the live blocks travel
        assert stats["num_blocks_swapped_out"] <= stats["num_preemptions_swap"] * max_live_blocks(WINDOW, BLOCK)
    if caching:  # prompts starting as theirs did hit only blocks that hold that KV (the worker checks)
        run(sched, [request(f"probe{i}", [20 + i] * 4 + [99], max_tokens=2) for i in range(3)], ahead, worker=worker)
    assert_all_blocks_free(sched)


def test_forks_share_the_live_blocks_and_prefix_hits_stop_at_what_the_window_needs():
    sched = Scheduler(config(num_gpu_blocks=40, enable_prefix_caching=True))  # room: the freed prompt stays cached
    prompt = list(range(30, 60))
    deltas, _, worker = run(sched, [request("a", prompt, max_tokens=20, n=3)])
    assert len(outputs(deltas)["a"]) == 60
    deltas, _, _ = run(sched, [request("b", prompt, max_tokens=4)], worker=worker)
    assert sched.stats()["prefix_cache_hits"] > 0 and len(outputs(deltas)["b"]) == 4


def test_speculative_proposals_stay_inside_the_window():
    spec = SpeculativeConfig("ngram", 3, 4, 1)
    sched = Scheduler(config(speculative=spec))
    deltas, peak, _ = run(sched, [request("s", [5, 6, 7, 8] * 4, max_tokens=80)],
                          next_token=lambda req_id, tokens: tokens[-4] if len(tokens) % 23 else 9)
    assert len(outputs(deltas)["s"]) == 80
    stats = sched.stats()  # proposals made, some rejected: the next query moved back after a freeing step
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert peak["blocks"] <= max_live_blocks(WINDOW, BLOCK) + 1  # a step's proposals may start a block


@pytest.mark.parametrize("layout", [dict(sliding_window=WINDOW), dict(num_window_groups=1, hybrid_window=WINDOW)])
def test_the_invariants_catch_blocks_freed_that_a_rejected_proposal_would_read_again(layout):
    """Blocks freed behind the window of a step's last proposal, while the proposals may still be
    rejected (the next query would move back into them): the debug check names the sequence."""
    sched = Scheduler(config(**{"sliding_window": 0, **layout}, speculative=SpeculativeConfig("ngram", 3, 4, 1)))
    sched.add_request(request("s", [5, 6, 7, 8] * 4, max_tokens=80))
    worker, bm = SimWorker(sched.config, lambda req_id, tokens: tokens[-4]), sched.bm
    for _ in range(80):
        out = sched.schedule()
        (seq,) = sched.running.in_order()
        drafts = len(seq.spec.drafts) if seq.spec is not None else 0
        freed = seq.num_window_freed if bm.num_window_groups else seq.num_freed_blocks
        if blocks_behind(seq.num_kv_tokens, WINDOW, BLOCK) > max(freed, blocks_behind(seq.num_kv_tokens - drafts,
                                                                                   WINDOW, BLOCK)):
            break
        sched.update_from_output(out, worker.step(out))
    else:
        pytest.fail("no step's proposals crossed a block behind the window")
    bm.release_behind_window(seq, seq.num_kv_tokens)  # as if every proposal were already accepted
    with pytest.raises(InvariantError, match=r"^s: \d+ (blocks|local entries) freed, but (its|the local) window"):
        sched.check_invariants()


def test_which_models_free_and_what_the_log_says():
    assert window_to_free([8, 8, 8], draft_model=False) == (8, "every layer attends within 8 positions: "
                                                               "KV blocks behind the window are freed")
    window, note = window_to_free([4096, 0, 4096, 0], draft_model=False)  # Gemma 2, gpt-oss
    assert window == 0 and "every KV block is kept" in note and "not in KV groups" in note
    window, note = window_to_free([4096, 0, 4096, 0], draft_model=False, hybrid_kv=True)
    assert window == 0 and "their 1 KV group(s) free blocks behind the window" in note
    window, note = window_to_free([8, 8], draft_model=True)
    assert window == 0 and "draft model" in note
    assert window_to_free([0, 0], draft_model=False) == (0, None)
    assert window_to_free([], draft_model=False) == (0, None)  # an older worker's hello
    with pytest.raises(ValueError, match="draft model"):
        config(speculative=SpeculativeConfig("draft_model", 2, 0, 0, model="/nonexistent"))
