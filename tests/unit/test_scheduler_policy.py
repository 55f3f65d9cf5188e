"""Scheduling policy, driven through the real Scheduler with a simulated worker."""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.policy import FcfsPolicy
from pagedserve.scheduler_proc.scheduler import Scheduler, SchedulerStateError

from support.scheduler_sim import (
    SimWorker, assert_all_blocks_free, counting_tokens, random_tokens, request, run_until_done, swap_one_out,
)


def make(**overrides) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(debug_invariants=True, **overrides)
    return Scheduler(config), SimWorker(config, counting_tokens())


def step(sched: Scheduler, worker: SimWorker):
    out = sched.schedule()
    return out, sched.update_from_output(out, worker.step(out))


def scheduled_ids(out) -> list[str]:
    return [r.req_id for r in (*out.new_requests, *out.cached_requests)] + out.decodes.req_ids


def test_decodes_of_different_lengths_all_run_every_step_without_preemption():
    sched, worker = make(block_size=4, num_gpu_blocks=256, max_num_seqs=8, max_num_batched_tokens=128)
    lengths = [3, 17, 30, 5, 11, 24]
    max_tokens = {f"r{i}": 5 + 3 * i for i in range(len(lengths))}
    for i, length in enumerate(lengths):
        sched.add_request(request(f"r{i}", list(range(10, 10 + length)), max_tokens=max_tokens[f"r{i}"],
                                  ignore_eos=True))
    unfinished = set(max_tokens)
    computed = 0

    def on_step(out, result, deltas):
        nonlocal computed
        assert sorted(scheduled_ids(out)) == sorted(unfinished), f"step {out.step} left someone out"
        unfinished.difference_update(d.request_id for d in deltas if d.finish_reason)
        computed += out.total_num_scheduled_tokens

    run_until_done(sched, worker, on_step=on_step)
    stats = sched.stats()
    assert stats["num_preemptions_recompute"] == stats["num_preemptions_swap"] == 0
    # Every prompt token once, every output but the last once: nothing was computed twice.
    assert computed == sum(lengths) + sum(m - 1 for m in max_tokens.values())
    assert stats["prompt_tokens"] == sum(lengths) and stats["recomputed_tokens"] == 0
    assert stats["generation_tokens"] == sum(max_tokens.values())
    assert_all_blocks_free(sched)


def test_under_memory_pressure_the_newest_request_is_preempted_and_the_oldest_keeps_running():
    # 8 blocks of 4 tokens: three 7-token prompts take 6 (admission keeps one spare block per
    # running request); once each holds 8 tokens, the next decodes need 3 blocks and 2 are free.
    sched, worker = make(block_size=4, num_gpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=32,
                         preemption_mode="recompute")
    for rid in ("old", "mid", "new"):
        sched.add_request(request(rid, list(range(20, 27)), max_tokens=6, ignore_eos=True))
    out, _ = step(sched, worker)
    assert scheduled_ids(out) == ["old", "mid", "new"]
    out, _ = step(sched, worker)  # each writes its 8th token into its second block
    out, _ = step(sched, worker)  # old needs a third block: new (the newest) must go
    assert out.finished_req_ids == ["new"]
    assert scheduled_ids(out) == ["old", "mid"]
    assert [s.seq_id for s in sched.waiting] == ["new"]
    assert sched.stats()["num_preemptions_recompute"] == 1


def test_forty_concurrent_requests_on_a_tight_cache_all_finish_in_arrival_order():
    # 16 seats, ~9 blocks per finished request: 48 blocks hold about five at full length.
    sched, worker = make(block_size=4, num_gpu_blocks=48, max_num_seqs=16, max_num_batched_tokens=64,
                         preemption_mode="recompute")
    rng = random.Random(3)
    for i in range(40):
        prompt = [rng.randrange(10, 500) for _ in range(rng.randint(6, 14))]
        sched.add_request(request(f"r{i:02d}", prompt, max_tokens=24, ignore_eos=True))
    finish_order = []
    preempted = {}  # request id -> times the workers were told to drop it before it finished

    def on_step(out, result, deltas):
        for rid in out.finished_req_ids:
            if rid in sched.requests:
                preempted[rid] = preempted.get(rid, 0) + 1
        finish_order.extend(d.request_id for d in deltas if d.finish_reason)

    run_until_done(sched, worker, on_step=on_step)
    assert finish_order == [f"r{i:02d}" for i in range(40)]
    assert sched.stats()["num_preemptions_recompute"] > 0, "the cache was meant to be tight"
    # docs/DECISIONS.md: the admission reserve keeps this workload to one preemption per request
    assert max(preempted.values()) == 1, preempted
    assert_all_blocks_free(sched)


def test_swap_preemption_moves_blocks_out_and_back_and_resumes_before_newer_waiting_requests():
    sched, worker = make(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, max_num_seqs=4,
                         max_num_batched_tokens=32, preemption_mode="swap")
    for rid in ("old", "mid", "new"):
        sched.add_request(request(rid, list(range(30, 37)), max_tokens=8, ignore_eos=True))
    step(sched, worker)
    step(sched, worker)
    out, _ = step(sched, worker)
    swapped_out = dict(out.blocks_to_swap_out)
    assert len(swapped_out) == 2 and out.finished_req_ids == ["new"]
    assert [s.seq_id for s in sched.swapped] == ["new"]
    sched.add_request(request("later", list(range(40, 44)), max_tokens=2))
    swapped_in = None
    while swapped_in is None:
        out, _ = step(sched, worker)
        if "new" in [r.req_id for r in out.new_requests]:
            swapped_in = out
        else:
            assert "later" not in scheduled_ids(out), "a newer request overtook a swapped one"
    moved_back = {host: dev for host, dev in swapped_in.blocks_to_swap_in if host in swapped_out.values()}
    assert sorted(moved_back) == sorted(swapped_out.values())
    resumed = [r for r in swapped_in.new_requests if r.req_id == "new"][0]
    assert resumed.num_computed_tokens == 8
    assert resumed.block_ids[:2] == [moved_back[swapped_out[d]] for d in sorted(swapped_out)]
    run_until_done(sched, worker)
    stats = sched.stats()
    assert stats["num_preemptions_swap"] >= 1 and stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"]
    assert_all_blocks_free(sched)


def test_recompute_preemption_resumes_before_newer_waiting_requests():
    sched, worker = make(block_size=4, num_gpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=32,
                         preemption_mode="recompute")
    for rid in ("old", "mid", "new"):
        sched.add_request(request(rid, list(range(20, 27)), max_tokens=6, ignore_eos=True))
    for _ in range(3):
        step(sched, worker)
    sched.add_request(request("later", list(range(50, 53)), max_tokens=2))
    admitted = []
    run_until_done(sched, worker, on_step=lambda out, result, deltas: admitted.extend(
        r.req_id for r in out.new_requests if r.req_id in ("new", "later")))
    assert admitted.index("new") < admitted.index("later")
    resumed = sched.stats()
    assert resumed["recomputed_tokens"] == 8  # the 7 prompt tokens and 1 output computed before
    assert_all_blocks_free(sched)


def test_a_long_prompt_is_prefilled_in_chunks_while_decodes_continue_every_step():
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    sched.add_request(request("short", [5, 6, 7], max_tokens=30, ignore_eos=True))
    step(sched, worker)
    sched.add_request(request("long", list(range(100, 160)), max_tokens=2))
    chunks = []
    while "long" not in [d.request_id for d in step_and_deltas(sched, worker, chunks)]:
        pass
    assert sum(chunks) == 60 and len(chunks) == 4 and max(chunks) == 15  # 16 minus short's decode
    assert sched.stats()["num_preemptions_recompute"] == 0


def step_and_deltas(sched, worker, chunks):
    out, deltas = step(sched, worker)
    assert "short" in scheduled_ids(out), "a prefill chunk starved a decode"
    chunks.extend(r.num_scheduled_tokens for r in (*out.new_requests, *out.cached_requests) if r.req_id == "long"
                  and r.num_computed_tokens < 60)
    return deltas


def history_tokens(req_id: str, tokens: list[int]) -> int:
    """A token that depends on every token before it, so any slip in what was computed shows."""
    return 10 + hash(tuple(tokens)) % 900


def test_a_prompt_longer_than_the_token_budget_is_computed_in_budget_sized_chunks_with_the_same_output():
    def run(budget: int) -> tuple[list[int], list[int]]:
        config = SchedulerConfig(debug_invariants=True, block_size=4, num_gpu_blocks=64, max_num_seqs=4,
                                 max_num_batched_tokens=budget)
        sched, worker = Scheduler(config), SimWorker(config, history_tokens)
        sched.add_request(request("long", list(range(100, 160)), max_tokens=5, ignore_eos=True))
        chunks, outputs = [], []

        def on_step(out, result, deltas):
            chunks.extend(r.num_scheduled_tokens for r in out.new_requests + out.cached_requests)
            outputs.extend(result.sampled_token_ids)

        run_until_done(sched, worker, on_step=on_step)
        assert_all_blocks_free(sched)
        return chunks, outputs

    chunked, chunked_output = run(16)
    whole, whole_output = run(64)
    assert chunked == [16, 16, 16, 12] and whole == [60]
    assert chunked_output == whole_output and len(whole_output) == 5


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                         max_model_len=64, enable_chunked_prefill=False)
    assert sched.config.max_num_batched_tokens == 64
    sched.add_request(request("long", list(range(100, 160)), max_tokens=2))
    out, _ = step(sched, worker)
    assert [r.num_scheduled_tokens for r in out.new_requests] == [60]


def test_the_head_of_the_waiting_queue_is_never_overtaken():
    sched, worker = make(block_size=4, num_gpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(request("running", list(range(10, 22)), max_tokens=10, ignore_eos=True))
    step(sched, worker)
    sched.add_request(request("big", list(range(30, 50)), max_tokens=2))  # 5 blocks: not now
    sched.add_request(request("small", [1, 3], max_tokens=2))  # would fit, but is newer
    out, _ = step(sched, worker)
    assert scheduled_ids(out) == ["running"]
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_random_tokens_with_eos_finish_every_request():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=20, max_num_seqs=6, max_num_batched_tokens=24,
                             debug_invariants=True)
    sched = Scheduler(config)
    worker = SimWorker(config, random_tokens(random.Random(0), 0.1))
    for i in range(12):
        sched.add_request(request(f"r{i}", list(range(i, i + 9)), max_tokens=15))
    run_until_done(sched, worker)
    assert sched.stats()["num_finished"] == 12
    assert_all_blocks_free(sched)


class _NamedVictim(FcfsPolicy):
    """FCFS, but the victim is the running sequence of one named request when it runs."""

    def __init__(self, victim_id: str):
        self.victim_id = victim_id

    def victim(self, running):
        named = [s for s in running.per_object() if s.seq_id == self.victim_id]
        return named[0] if named else super().victim(running)


class _NewestFirst(FcfsPolicy):
    def next_to_start(self, swapped, waiting):
        return swapped[0] if swapped else (waiting[-1] if waiting else None)


@pytest.mark.parametrize("logprobs", [None, 1])  # with logprobs, per-object sequences rather than steady decodes
def test_the_scheduler_preempts_whichever_running_sequence_its_policy_names(logprobs):
    # 8 blocks of 4 tokens, prompts of 7, 7 and 8 tokens: at step 3 "old" and "mid" each need
    # a third block and one is free. "old" takes it; for "mid", FCFS preempts the newest, "new",
    # whose blocks then serve "mid"; a policy that names "mid" makes "mid" give way instead.
    config = SchedulerConfig(debug_invariants=True, block_size=4, num_gpu_blocks=8, max_num_seqs=4,
                             max_num_batched_tokens=32, preemption_mode="recompute")
    for policy, victim, kept in ((None, "new", ["mid", "old"]), (_NamedVictim("mid"), "mid", ["new", "old"])):
        sched, worker = Scheduler(config, policy=policy), SimWorker(config, counting_tokens())
        for rid, length in (("old", 7), ("mid", 7), ("new", 8)):
            sched.add_request(request(rid, list(range(20, 20 + length)), max_tokens=6, ignore_eos=True,
                                      logprobs=logprobs))
        step(sched, worker)
        step(sched, worker)
        out, _ = step(sched, worker)
        assert out.finished_req_ids == [victim]
        assert sorted(scheduled_ids(out)) == kept
        assert [s.seq_id for s in sched.waiting] == [victim]
        run_until_done(sched, worker)
        assert_all_blocks_free(sched)


def test_waiting_sequences_start_in_the_order_the_policy_names():
    config = SchedulerConfig(debug_invariants=True, block_size=4, num_gpu_blocks=64, max_num_seqs=1,
                             max_num_batched_tokens=32)
    sched, worker = Scheduler(config, policy=_NewestFirst()), SimWorker(config, counting_tokens())
    for rid in ("a", "b", "c"):
        sched.add_request(request(rid, list(range(20, 27)), max_tokens=2, ignore_eos=True))
    started = []

    def on_step(out, result, deltas):
        started.extend(r.req_id for r in out.new_requests)

    run_until_done(sched, worker, on_step=on_step)
    assert started == ["c", "b", "a"]
    assert_all_blocks_free(sched)


def test_a_recomputed_older_sequence_starts_before_a_newer_swapped_one():
    """FCFS across both queues: the head of waiting (preempted by recomputation, so it lost its
    blocks) is older than the head of swapped, so it goes first (found by a fuzzer: under auto
    preemption a sequence holding under one block is recomputed while a newer one is swapped)."""
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    for name, length in (("old", 6), ("new", 9)):
        sched.add_request(request(name, list(range(10, 10 + length)), max_tokens=4, ignore_eos=True))
    old, new = (sched.requests[name].sequences[0] for name in ("old", "new"))
    sched.waiting.clear()
    sched.waiting.append(old)  # as if preempted by recomputation
    sched.swapped.append(new)  # as if swapped out (its host blocks do not matter to the choice)
    assert sched.policy.next_to_start(sched.swapped, sched.waiting) is old
    sched.swapped.clear()
    sched.waiting.append(new)
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_a_policy_that_names_a_sequence_already_scheduled_this_step_as_its_victim_is_refused():
    # as above, but the policy names "old", which took the free block before "mid" asked for one
    config = SchedulerConfig(debug_invariants=True, block_size=4, num_gpu_blocks=8, max_num_seqs=4,
                             max_num_batched_tokens=32, preemption_mode="recompute")
    sched, worker = Scheduler(config, policy=_NamedVictim("old")), SimWorker(config, counting_tokens())
    for rid, length in (("old", 7), ("mid", 7), ("new", 8)):
        sched.add_request(request(rid, list(range(20, 20 + length)), max_tokens=6, ignore_eos=True, logprobs=1))
    step(sched, worker)
    step(sched, worker)
    with pytest.raises(SchedulerStateError, match="the policy chose 'old', already scheduled this step, as a victim"):
        sched.schedule()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_every_preemption_is_counted_by_its_kind_and_a_recomputed_sequence_copies_no_block(mode):
    sched, worker = make(block_size=4, num_gpu_blocks=8, num_cpu_blocks=16, max_num_seqs=4,
                         max_num_batched_tokens=32, preemption_mode=mode)
    for i in range(5):
        sched.add_request(request(f"r{i}", list(range(20 + i, 27 + i)), max_tokens=12, ignore_eos=True))
    preempted, copies = [], []

    def on_step(out, result, deltas):
        preempted.extend(rid for rid in out.finished_req_ids if rid in sched.requests)  # given way, not ended
        copies.extend(out.blocks_to_copy)

    deltas = run_until_done(sched, worker, on_step=on_step)
    stats = sched.stats()
    assert len(preempted) >= 2
    assert (stats["num_preemptions_swap"], stats["num_preemptions_recompute"]) == (
        (len(preempted), 0) if mode == "swap" else (0, len(preempted)))
    assert copies == []  # single samples: no block is ever shared, so none is copied
    assert sorted(d.request_id for d in deltas if d.finish_reason) == [f"r{i}" for i in range(5)]
    assert_all_blocks_free(sched)


def test_a_prefill_ahead_of_decodes_in_the_running_order_leaves_one_token_of_the_budget_for_each():
    # under priority the urgent prompt's chunks come first in the running order; the two older decodes
    # after it (per-object: logprobs) still run every step, and the step never exceeds its budget
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                         scheduling_policy="priority")
    for rid in ("low1", "low2"):
        msg = request(rid, [20, 21, 22], max_tokens=12, ignore_eos=True, logprobs=1)
        msg.priority = 5
        sched.add_request(msg)
    step(sched, worker)
    sched.add_request(request("urgent", list(range(30, 50)), max_tokens=2, ignore_eos=True))
    chunks = []
    for _ in range(4):  # the 20 prompt tokens: 6 at admission beside the 2 decodes, then 6, 6 and 2
        out, _ = step(sched, worker)
        chunks.append([(r.req_id, r.num_scheduled_tokens) for r in (*out.new_requests, *out.cached_requests)])
        assert out.total_num_scheduled_tokens <= 8
    assert chunks == [[("urgent", n), ("low1", 1), ("low2", 1)] for n in (6, 6, 6, 2)]
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_decodes_that_exactly_fill_the_cache_run_to_their_end_without_a_preemption():
    # 3 prompt tokens and 6 sampled (the last never computed): 8 positions, 2 blocks each, 4 in all
    sched, worker = make(block_size=4, num_gpu_blocks=4, max_num_seqs=2)
    for rid in ("a", "b"):  # logprobs: per-object decodes, each asking for its own token's room
        sched.add_request(request(rid, [20, 21, 22], max_tokens=6, ignore_eos=True, logprobs=1))
    deltas = run_until_done(sched, worker)
    assert sum(len(d.new_token_ids) for d in deltas) == 12
    assert (sched.stats()["num_preemptions_swap"], sched.stats()["num_preemptions_recompute"]) == (0, 0)
    assert_all_blocks_free(sched)


def test_a_waiting_request_that_fits_starts_in_the_step_a_swapped_one_resumes_in():
    sched, worker = make(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, max_num_seqs=4,
                         max_num_batched_tokens=32, preemption_mode="swap")
    swap_one_out(sched, worker)
    sched.add_request(request("later", [40, 41], max_tokens=2))
    out, _ = step(sched, worker)
    while not out.blocks_to_swap_in:
        assert "later" not in scheduled_ids(out), "a newer request overtook a swapped one"
        out, _ = step(sched, worker)
    assert [r.req_id for r in out.new_requests] == ["new", "later"]  # the swapped one first, then the rest
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)
