"""Prefix caching: full computed blocks are reused by later requests with the same prefix."""

from __future__ import annotations

from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import (SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done,
                                   swap_one_back_in, tokens_by_request)

SHARED = list(range(100, 112))  # three full blocks of 4


def make(**overrides) -> tuple[Scheduler, SimWorker]:
    settings = {"block_size": 4, "num_gpu_blocks": 32, **overrides}
    config = SchedulerConfig(enable_prefix_caching=True, debug_invariants=True, **settings)
    return Scheduler(config), SimWorker(config, counting_tokens())


def test_a_second_request_with_the_same_prefix_hits_the_cache_and_its_hit_blocks_are_not_zeroed():
    sched, worker = make()
    sched.add_request(request("first", SHARED + [1, 2], max_tokens=2))
    run_until_done(sched, worker)
    first_blocks = set(range(32)) - set(sched.bm.device.plain_free)  # kept as evictable cache entries
    sched.add_request(request("second", SHARED + [3], max_tokens=2))
    out = sched.schedule()
    [new] = out.new_requests
    assert new.num_computed_tokens == 12 and new.num_scheduled_tokens == 1
    hit_blocks = new.block_ids[:3]
    assert set(hit_blocks) <= first_blocks
    assert not set(hit_blocks) & set(out.new_block_ids_to_zero)
    assert out.new_block_ids_to_zero == [new.block_ids[3]]
    deltas = list(sched.update_from_output(out, worker.step(out)))  # the simulated worker checks the KV
    assert deltas[0].num_cached_tokens == 12
    stats = sched.stats()
    assert stats["prefix_cache_queries"] == 14 + 13 and stats["prefix_cache_hits"] == 12
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_a_hit_never_covers_the_last_prompt_token():
    sched, worker = make()
    sched.add_request(request("first", SHARED, max_tokens=1))
    run_until_done(sched, worker)
    sched.add_request(request("again", SHARED, max_tokens=1))
    [new] = sched.schedule().new_requests
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (8, 4)


def test_running_requests_share_prefix_blocks_once_they_are_computed():
    sched, worker = make()
    sched.add_request(request("first", SHARED + [1], max_tokens=10))
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    sched.add_request(request("second", SHARED + [2], max_tokens=10))
    out = sched.schedule()
    second = [r for r in out.new_requests if r.req_id == "second"][0]
    first_table = sched.requests["first"].sequences[0].block_ids
    assert second.block_ids[:3] == first_table[:3]
    assert [sched.bm.device.ref_counts[b] for b in first_table[:3]] == [2, 2, 2]


def test_evicting_a_cached_block_for_new_content_zeroes_it():
    sched, worker = make(num_gpu_blocks=4)
    sched.add_request(request("first", SHARED + [1], max_tokens=1))
    run_until_done(sched, worker)
    cached = set(sched.bm.device.evictable)
    assert len(cached) == 3
    sched.add_request(request("other", list(range(50, 63)), max_tokens=1))
    out = sched.schedule()
    assert cached <= set(out.new_block_ids_to_zero)
    assert not sched.bm.device.cache  # the evicted entries are gone with their contents
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_a_sequence_swapped_back_in_names_its_blocks_again_so_later_prompts_hit_them():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, max_num_seqs=4,
                             max_num_batched_tokens=32, preemption_mode="swap", enable_prefix_caching=True,
                             debug_invariants=True)
    sched, worker = Scheduler(config), SimWorker(config, counting_tokens())
    new = swap_one_back_in(sched, worker)
    sched.add_request(request("probe", list(new.token_ids[:4]) + [99], max_tokens=1))
    out = sched.schedule()
    [probe] = [r for r in out.new_requests if r.req_id == "probe"]
    assert probe.num_computed_tokens == 4 and probe.block_ids[0] == new.block_ids[0]
    sched.update_from_output(out, worker.step(out))  # the simulated worker checks the hit's KV
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_with_speculation_every_block_of_verified_tokens_is_named_and_a_later_prompt_hits_them_all():
    """Proposals still being verified never name a block (a rejection rewrites its KV); once the
    request ends, the same text as a prompt hits every block it computed."""
    config = SchedulerConfig(block_size=4, num_gpu_blocks=40, enable_prefix_caching=True, debug_invariants=True,
                             speculative=SpeculativeConfig("ngram", 3, 4, 1))
    sched = Scheduler(config)
    worker = SimWorker(config, lambda req_id, tokens: tokens[-4] if len(tokens) % 23 else 9)  # some rejected
    prompt = [5, 6, 7, 8] * 4
    sched.add_request(request("a", prompt, max_tokens=40))
    text = prompt + tokens_by_request(run_until_done(sched, worker))["a"]
    stats = sched.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    sched.add_request(request("b", text + [99], max_tokens=1))
    out = sched.schedule()
    [new] = out.new_requests
    assert new.num_computed_tokens == (len(text) - 1) // 4 * 4  # its last token was sampled, never computed
    sched.update_from_output(out, worker.step(out))  # the simulated worker checks the hits' KV
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)
