"""Admission's rules at their edges (scheduler_proc/admission.py, pure functions): the largest
request that fits is accepted, one token or block more is refused with a message that names
the numbers."""

from __future__ import annotations

import pytest

import msgspec

from pagedserve.protocol.messages import LoRAAdapter
from pagedserve.protocol.priority import priority_refusal
from pagedserve.protocol.sampling_params import StructuredOutputs
from pagedserve.scheduler_proc.admission import NewRequestVerdict, judge_new, length_limit, rejection_reason
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import (SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done,
                                   tokens_by_request)


def config(**overrides) -> SchedulerConfig:
    return SchedulerConfig(**{"block_size": 4, "num_gpu_blocks": 8, "max_model_len": 64, **overrides})


def test_the_length_limit_is_the_model_limit_or_the_whole_cache_plus_the_uncomputed_last_token():
    assert length_limit(config(max_model_len=20)) == 20
    assert length_limit(config(max_model_len=64)) == 8 * 4 + 1
    assert length_limit(config(max_model_len=33)) == 33


def test_a_prompt_one_token_short_of_the_model_limit_is_accepted_and_one_more_is_refused():
    assert rejection_reason(request("r", list(range(15))), config(max_model_len=16)) is None
    reason = rejection_reason(request("r", list(range(16))), config(max_model_len=16))
    assert reason == ("the prompt has 16 tokens; with at least one generated token that exceeds "
                      "max_model_len=16")


def test_a_prompt_that_fills_the_whole_cache_is_accepted_and_one_token_more_is_refused():
    assert rejection_reason(request("r", list(range(32))), config()) is None
    reason = rejection_reason(request("r", list(range(33))), config())
    assert reason == ("the prompt has 33 tokens and needs 9 KV blocks of 4 tokens, but the cache has "
                      "only 8 blocks")


def test_as_many_parallel_samples_as_running_seats_are_accepted_and_one_more_is_refused():
    assert rejection_reason(request("r", [1, 2, 3], n=4), config(max_num_seqs=4, num_gpu_blocks=64)) is None
    reason = rejection_reason(request("r", [1, 2, 3], n=5), config(max_num_seqs=4, num_gpu_blocks=64))
    assert reason == "n=5 parallel samples exceed max_num_seqs=4, the most sequences one step can run"


@pytest.mark.parametrize("prompt_len, n, needed", [(9, 6, 8), (5, 7, 8), (2, 7, 8)])
def test_parallel_samples_that_exactly_fill_the_cache_are_accepted(prompt_len, n, needed):
    # prompt[:-1] shared, plus one block per sample for the first token it writes
    assert -(-(prompt_len - 1) // 4) + n == needed
    assert rejection_reason(request("r", list(range(prompt_len)), n=n), config()) is None


def test_parallel_samples_one_block_over_the_cache_are_refused_naming_the_blocks():
    reason = rejection_reason(request("r", list(range(9)), n=7), config())
    assert reason == ("n=7 samples of a 9-token prompt need 9 KV blocks of 4 tokens at once, but the "
                      "cache has only 8 blocks")


@pytest.mark.parametrize("prompt_len, n", [(6, 7), (32, 2)])  # a 5-token prompt[:-1] fills 2 blocks; n=2 counts
def test_parallel_samples_count_the_shared_prompt_blocks_and_one_block_each(prompt_len, n):
    reason = rejection_reason(request("r", list(range(prompt_len)), n=n), config())
    assert reason is not None and reason.startswith(f"n={n} samples of a {prompt_len}-token prompt need")


def test_a_single_sample_does_not_count_the_parallel_sample_blocks():
    # n=1 needs only the prompt's blocks: 32 tokens fill 8 blocks exactly
    assert rejection_reason(request("r", list(range(32)), n=1), config()) is None


def test_field_ranges_and_the_vocabulary_are_checked_with_the_field_named():
    assert rejection_reason(request("r", [1, 2], max_tokens=2, min_tokens=3), config()).startswith("min_tokens:")
    assert rejection_reason(request("r", [1, 99]), config(vocab_size=99)).startswith("prompt_token_ids:")
    assert rejection_reason(request("r", [1, 98]), config(vocab_size=99)) is None


def judge(msg, cfg=None, in_use=(), grammars=None, num_waiting=0, adapters=None):
    return judge_new(msg, cfg or config(), set(in_use), grammars, num_waiting, adapters or {})


def test_a_request_id_already_in_use_is_refused_naming_the_id():
    assert judge(request("r", [1, 2]), in_use=["other"]) == NewRequestVerdict()
    assert judge(request("r", [1, 2]), in_use=["r"]) == NewRequestVerdict("request id 'r' is already in use")


def test_a_lora_adapter_is_accepted_only_when_registered():
    adapters = {"mine": LoRAAdapter(name="mine", lora_id=1, path="/nowhere", digest="d")}
    cfg = config(enable_lora=True)
    assert judge(msgspec.structs.replace(request("r", [1, 2]), lora_name="mine"), cfg, adapters=adapters).reason is None
    verdict = judge(msgspec.structs.replace(request("r", [1, 2]), lora_name="theirs"), cfg, adapters=adapters)
    assert verdict.kind == "invalid_request" and verdict.reason.startswith("LoRA adapter 'theirs' is not loaded")


class CompilingCache:
    """Stands in for the grammar cache (grammar_cache.py), which needs a model's tokenizer."""

    def compile(self, spec):
        return ("compiled", spec.regex)


def test_a_grammar_is_compiled_on_arrival_and_refused_where_no_cache_can_compile_it():
    msg = request("r", [1, 2], structured_outputs=StructuredOutputs(regex="a+"))
    assert judge(msg, grammars=CompilingCache()) == NewRequestVerdict(compiled=("compiled", "a+"))
    refused = judge(msg, grammars=None)
    assert refused.kind == "invalid_request"
    assert refused.reason.startswith("structured_outputs: structured output is not available")


def test_new_requests_are_shed_as_overloaded_once_the_waiting_queue_reaches_its_limit():
    cfg = config(max_waiting_requests=2)
    assert judge(request("r", [1, 2]), cfg, num_waiting=1) == NewRequestVerdict()
    assert judge(request("r", [1, 2]), cfg, num_waiting=2) == NewRequestVerdict(
        "the server is overloaded: 2 requests are waiting, the limit is 2 (--max-waiting-requests); "
        "retry later", "overloaded")
    assert judge(request("r", [1, 2]), config(), num_waiting=10**6) == NewRequestVerdict()


def test_a_request_that_can_never_be_served_is_refused_before_load_shedding():
    verdict = judge(request("r", list(range(33))), config(max_waiting_requests=1), num_waiting=5)
    assert verdict.kind == "invalid_request" and verdict.reason.startswith("the prompt has 33 tokens")


def test_a_refusal_ends_each_parallel_sample_or_one_delta_when_n_is_out_of_range():
    verdict = NewRequestVerdict("why", "overloaded")
    deltas = verdict.error_deltas(request("r", [1, 2, 3], n=4), max_num_seqs=4)
    assert [(d.request_id, d.index, d.new_token_ids, d.finish_reason, d.error, d.error_kind, d.num_prompt_tokens)
            for d in deltas] == [("r", i, [], "error", "why", "overloaded", 3) for i in range(4)]
    assert [d.index for d in verdict.error_deltas(request("r", [1], n=5), max_num_seqs=4)] == [0]
    assert [d.index for d in verdict.error_deltas(request("r", [1], n=1), max_num_seqs=4)] == [0]


def scheduler(**overrides) -> tuple[Scheduler, SimWorker]:
    cfg = SchedulerConfig(debug_invariants=True, **{"block_size": 4, "num_gpu_blocks": 32, **overrides})
    return Scheduler(cfg), SimWorker(cfg, counting_tokens())


def tokens_by_sample(deltas) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in deltas:
        out.setdefault(d.index, []).extend(d.new_token_ids)
    return out


def test_parallel_samples_of_a_prompt_whose_blocks_are_all_cached_fork_at_admission():
    prompt = list(range(100, 108)) + [7]  # prompt[:-1] is two full blocks
    uncached, worker = scheduler()
    uncached.add_request(request("many", prompt, max_tokens=3, n=3))
    expected = tokens_by_sample(run_until_done(uncached, worker))

    sched, worker = scheduler(enable_prefix_caching=True)
    sched.add_request(request("first", prompt, max_tokens=2))
    run_until_done(sched, worker)
    sched.add_request(request("many", prompt, max_tokens=3, n=3))
    out = sched.schedule()  # no prompt token left to compute: each sample computes the last one now
    assert sorted((r.req_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in out.new_requests) == [
        ("many/0", 8, 1), ("many/1", 8, 1), ("many/2", 8, 1)]
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert tokens_by_sample(deltas) == expected  # the simulated worker checked every KV slot read
    sched.add_request(request("again", prompt, max_tokens=1))
    run_until_done(sched, worker)
    assert sched.stats()["prefix_cache_hits"] == 8 + 8
    assert_all_blocks_free(sched)


def test_parallel_samples_are_admitted_beside_a_running_sequence_when_the_seats_exactly_suffice():
    sched, worker = scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(request("one", [1, 2, 3], max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    sched.add_request(request("three", [4, 5, 6], max_tokens=2, n=3))
    out = sched.schedule()
    assert [r.req_id for r in out.new_requests] == ["three"]  # 1 running + 3 samples = max_num_seqs
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_samples_forked_at_admission_start_only_as_far_as_the_step_budget_goes():
    prompt = list(range(100, 108)) + [7]
    sched, worker = scheduler(enable_prefix_caching=True, max_num_seqs=4, max_num_batched_tokens=4)
    sched.add_request(request("first", prompt, max_tokens=1))
    run_until_done(sched, worker)
    sched.add_request(request("ahead", [1, 2, 3], max_tokens=2))  # takes 3 of the step's 4 tokens
    sched.add_request(request("many", prompt, max_tokens=2, n=3))
    out = sched.schedule()
    assert sorted((r.req_id, r.num_scheduled_tokens) for r in out.new_requests)[0] == ("ahead", 3)
    assert len([r for r in out.new_requests if r.req_id.startswith("many/")]) == 1
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    many = {i: t for i, t in tokens_by_sample(d for d in deltas if d.request_id == "many").items()}
    assert sorted(many) == [0, 1, 2] and all(len(t) == 2 for t in many.values())
    assert_all_blocks_free(sched)


def test_the_last_free_seat_admits_a_single_sample_request():
    sched, worker = scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(request(f"r{i}", [1, 2, 3 + i], max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    sched.add_request(request("fourth", [9, 8, 7], max_tokens=2))
    out = sched.schedule()
    assert [r.req_id for r in out.new_requests] == ["fourth"]
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_the_last_token_of_the_step_budget_admits_a_one_token_chunk():
    sched, worker = scheduler(max_num_seqs=4, max_num_batched_tokens=4)
    sched.add_request(request("ahead", [1, 2, 3], max_tokens=2))
    sched.add_request(request("next", [4, 5, 6, 7, 8], max_tokens=2))
    out = sched.schedule()
    assert sorted((r.req_id, r.num_scheduled_tokens) for r in out.new_requests) == [("ahead", 3), ("next", 1)]
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt_though_it_is_cached():
    prompt = list(range(100, 108)) + [7]  # two full blocks cached by the first request
    sched, worker = scheduler(enable_prefix_caching=True)
    sched.add_request(request("first", prompt, max_tokens=1))
    run_until_done(sched, worker)
    sched.add_request(request("cached", prompt, max_tokens=1))
    sched.add_request(request("logprobs", prompt, max_tokens=1, prompt_logprobs=0))
    out = sched.schedule()
    assert sorted((r.req_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in out.new_requests) == [
        ("cached", 8, 1), ("logprobs", 0, 9)]


@pytest.mark.parametrize("pooling, cached", [("mean", 0), ("last", 8)])
def test_a_mean_pooled_embedding_computes_its_whole_prompt_and_a_last_token_one_reuses_the_cache(pooling, cached):
    prompt = list(range(100, 108)) + [7]
    sched, worker = scheduler(enable_prefix_caching=True)
    sched.add_request(request("first", prompt, max_tokens=1))
    run_until_done(sched, worker)
    sched.add_request(msgspec.structs.replace(request("embed", prompt, max_tokens=1), pooling=pooling))
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_requests] == [("embed", cached)]


def test_parallel_samples_that_fork_at_admission_wait_until_each_sample_has_its_first_block():
    prompt = list(range(100, 108)) + [7]  # prompt[:-1]: two cached blocks; three samples need three more
    sched, worker = scheduler(enable_prefix_caching=True, num_gpu_blocks=6, max_num_seqs=4)
    sched.add_request(request("first", prompt, max_tokens=1))
    run_until_done(sched, worker)
    sched.add_request(request("one", [1, 2, 3], max_tokens=2))
    out = sched.schedule()
    deltas = list(sched.update_from_output(out, worker.step(out)))
    sched.add_request(request("many", prompt, max_tokens=2, n=3))
    out = sched.schedule()  # 2 hits + 3 blocks + 1 kept for "one" to grow into: 6, but "one" holds one
    assert [r.req_id for r in out.new_requests] == []
    deltas += list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    many = tokens_by_sample(d for d in deltas if d.request_id == "many")
    assert sorted(many) == [0, 1, 2] and all(len(t) == 2 for t in many.values())
    assert_all_blocks_free(sched)


def test_a_window_of_one_token_still_reserves_the_null_block_and_bounds_a_sequence():
    # the null block (what a table entry freed behind the window names) is never a sequence's
    assert length_limit(config(sliding_window=1)) == 64  # the window bounds the blocks: the model's limit
    assert length_limit(config(sliding_window=1, enable_chunked_prefill=False)) == 7 * 4 + 1
    reason = rejection_reason(request("r", list(range(29))), config(sliding_window=1, enable_chunked_prefill=False))
    assert reason == "the prompt has 29 tokens and needs 8 KV blocks of 4 tokens, but the cache has only 7 blocks"


def test_a_cache_of_exactly_one_windows_live_blocks_bounds_a_sequence_by_the_model_limit_only():
    # window 8 in blocks of 4: 3 blocks live at most; 4 blocks less the null block hold them exactly
    assert length_limit(config(sliding_window=8, num_gpu_blocks=4)) == 64
    assert length_limit(config(sliding_window=8, num_gpu_blocks=3)) == 2 * 4 + 1


def hybrid(**overrides) -> SchedulerConfig:
    return config(**{"num_window_groups": 1, "hybrid_window": 4, **overrides})


def test_a_hybrid_models_length_limit_counts_every_local_table():
    # without chunked prefill each local table may be as long as the global one: 10 usable blocks / 2 tables
    assert length_limit(hybrid(num_gpu_blocks=11, enable_chunked_prefill=False)) == 5 * 4 + 1
    # chunked: each local table stays within its window's live blocks (2 here), the rest is the global table's
    assert length_limit(hybrid(num_gpu_blocks=11)) == (10 - 2) * 4 + 1
    # two local tables of 4 live blocks (window 12) leave 2 of 10 usable blocks, less than one table's bound:
    # then every table is as long as the global one
    assert length_limit(hybrid(num_gpu_blocks=11, num_window_groups=2, hybrid_window=12)) == 10 // 3 * 4 + 1


def test_a_hybrid_prompt_needs_its_local_tables_blocks_too_named_in_the_refusal():
    # 9 tokens: 3 blocks in the global table, and as many in the local one without chunked prefill
    cfg = hybrid(num_gpu_blocks=6, enable_chunked_prefill=False)
    prompt = request("r", list(range(9)))
    assert rejection_reason(prompt, hybrid(num_gpu_blocks=7, enable_chunked_prefill=False)) is None
    assert rejection_reason(request("r", list(range(9))), cfg) == (
        "the prompt has 9 tokens and needs 6 KV blocks of 4 tokens, but the cache has only 5 blocks")
    # chunked: the local table holds at most its window's 2 live blocks
    assert rejection_reason(request("r", list(range(9))), hybrid(num_gpu_blocks=6)) is None
    assert rejection_reason(request("r", list(range(9))), hybrid(num_gpu_blocks=5)) == (
        "the prompt has 9 tokens and needs 5 KV blocks of 4 tokens, but the cache has only 4 blocks")


def test_hybrid_parallel_samples_need_a_first_block_in_every_table_each():
    # prompt[:-1] = 4 tokens: one block in each of the 2 tables; 2 samples: 2 blocks each
    samples = request("r", list(range(5)), n=2)
    assert rejection_reason(samples, hybrid(enable_chunked_prefill=False, num_gpu_blocks=7)) is None
    assert rejection_reason(samples, hybrid(enable_chunked_prefill=False, num_gpu_blocks=6)) == (
        "n=2 samples of a 5-token prompt need 6 KV blocks of 4 tokens at once, but the cache has only 5 blocks")


def test_a_non_zero_priority_is_refused_where_the_policy_has_no_priorities():
    msg = request("r", [1, 2])
    msg.priority = 1
    assert rejection_reason(msg, config()) == priority_refusal("fcfs", 1)
    assert rejection_reason(msg, config(scheduling_policy="priority")) is None


def new_chunks(out) -> list[tuple[str, int]]:
    return [(r.req_id, r.num_scheduled_tokens) for r in out.new_requests]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits_and_nothing_behind_it_overtakes_it():
    sched, worker = scheduler(enable_chunked_prefill=False, max_model_len=8, max_num_batched_tokens=10,
                              max_num_seqs=8)
    for rid, size in (("a", 5), ("b", 5), ("c", 6), ("d", 3), ("e", 1)):
        sched.add_request(request(rid, list(range(10, 10 + size)), max_tokens=2))
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append(new_chunks(out))
        sched.update_from_output(out, worker.step(out))
    # b exactly fills the step; d (3 tokens) does not fit the 2 left beside c and the decodes: e waits behind it
    assert steps == [[("a", 5), ("b", 5)], [("c", 6)], [("d", 3), ("e", 1)]]
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def preemptions(sched: Scheduler) -> tuple[int, int]:
    stats = sched.stats()
    return stats["num_preemptions_swap"], stats["num_preemptions_recompute"]


@pytest.mark.parametrize("mode, swapped", [("auto", False), ("swap", True)])
def test_a_victim_under_one_block_is_recomputed_unless_swap_is_asked_for(mode, swapped):
    sched, worker = scheduler(scheduling_policy="priority", num_cpu_blocks=8, max_num_seqs=2, preemption_mode=mode)
    for rid in ("old", "young"):
        msg = request(rid, [20, 21], max_tokens=6, ignore_eos=True)
        msg.priority = 5
        sched.add_request(msg)
    out = sched.schedule()
    deltas = list(sched.update_from_output(out, worker.step(out)))
    sched.add_request(request("urgent", [40, 41], max_tokens=2, ignore_eos=True))
    out = sched.schedule()  # "young" (2 tokens of KV, half a block) gives way at once
    assert out.finished_req_ids == ["young"]
    assert (len(out.blocks_to_swap_out), preemptions(sched)) == ((1, (1, 0)) if swapped else (0, (0, 1)))
    deltas += list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    lengths = {rid: len(tokens) for rid, tokens in tokens_by_request(deltas).items()}
    assert lengths == {"old": 6, "young": 6, "urgent": 2}
    assert_all_blocks_free(sched)


def test_in_auto_mode_a_victim_holding_exactly_one_full_block_is_swapped():
    sched, worker = scheduler(num_gpu_blocks=3, num_cpu_blocks=8, max_num_seqs=2)
    sched.add_request(request("a", [10, 11, 12, 13], max_tokens=8, ignore_eos=True))  # one full block
    sched.add_request(request("b", [20], max_tokens=8, ignore_eos=True))  # a's next block is kept free for it
    swapped_out = []
    run_until_done(sched, worker, on_step=lambda out, result, deltas: swapped_out.extend(out.blocks_to_swap_out))
    # b needs its second block at its fifth token when a holds the last free one: 4 tokens of KV, one block
    assert (len(swapped_out), preemptions(sched)) == (1, (1, 0))
    assert_all_blocks_free(sched)


WINDOWED = {"window": {"sliding_window": 8}, "hybrid": {"num_window_groups": 1, "hybrid_window": 8}}


@pytest.mark.parametrize("kind", WINDOWED)
def test_a_one_token_prompt_starts_on_a_model_with_a_window(kind):
    sched, worker = scheduler(**WINDOWED[kind])
    sched.add_request(request("one", [7], max_tokens=3, ignore_eos=True))
    out = sched.schedule()
    assert new_chunks(out) == [("one", 1)]
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert len(tokens_by_request(deltas)["one"]) == 3
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("kind", WINDOWED)
def test_parallel_samples_of_a_cached_prompt_fork_at_admission_on_a_model_with_a_window(kind):
    prompt = list(range(100, 108)) + [7]  # prompt[:-1] is two full blocks, inside the window
    uncached, worker = scheduler(**WINDOWED[kind])
    uncached.add_request(request("many", prompt, max_tokens=3, n=3))
    expected = tokens_by_sample(run_until_done(uncached, worker))

    sched, worker = scheduler(enable_prefix_caching=True, **WINDOWED[kind])
    sched.add_request(request("first", prompt, max_tokens=2))
    run_until_done(sched, worker)
    sched.add_request(request("many", prompt, max_tokens=3, n=3))
    out = sched.schedule()
    assert sorted((r.req_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in out.new_requests) == [
        ("many/0", 8, 1), ("many/1", 8, 1), ("many/2", 8, 1)]
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert tokens_by_sample(deltas) == expected
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("num_gpu_blocks, both_start", [(5, True), (4, False)])
def test_a_windowed_request_starts_beside_another_only_when_both_windows_fit(num_gpu_blocks, both_start):
    # window 4 in blocks of 4: each sequence holds at most 2 blocks; "a" holds 1 after its prompt and may
    # grow by 1, "b" takes 1 now and may grow by 1: 3 free blocks beside "a" (4 usable of 5, the null block aside)
    sched, worker = scheduler(sliding_window=4, num_gpu_blocks=num_gpu_blocks)
    sched.add_request(request("a", [10, 11, 12], max_tokens=8, ignore_eos=True))
    sched.add_request(request("b", [20, 21, 22], max_tokens=8, ignore_eos=True))
    out = sched.schedule()
    assert new_chunks(out) == ([("a", 3), ("b", 3)] if both_start else [("a", 3)])
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert {rid: len(tokens) for rid, tokens in tokens_by_request(deltas).items()} == {"a": 8, "b": 8}
    assert_all_blocks_free(sched)


def test_a_hybrid_prompt_whose_tables_do_not_fit_at_once_starts_alone_in_a_chunk_that_fits():
    # 12 tokens: 3 global blocks and 3 local ones at once, 6 of the 5 usable; a chunk of 8 takes 2 + 2
    sched, worker = scheduler(num_window_groups=1, hybrid_window=4, num_gpu_blocks=6)
    sched.add_request(request("long", list(range(10, 22)), max_tokens=1))  # 13 tokens: its length limit
    out = sched.schedule()
    assert new_chunks(out) == [("long", 8)]
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert len(tokens_by_request(deltas)["long"]) == 1
    assert_all_blocks_free(sched)


def test_parallel_samples_ask_for_their_own_blocks_only_when_they_fork():
    # the parent computes prompt[:-1] (2 blocks) beside "a" (1 block, 1 kept for it to grow into): 4 of 5
    sched, worker = scheduler(num_gpu_blocks=5, max_num_seqs=4)
    sched.add_request(request("a", [1, 2, 3], max_tokens=3, ignore_eos=True))
    out = sched.schedule()
    deltas = list(sched.update_from_output(out, worker.step(out)))
    sched.add_request(request("many", list(range(100, 109)), max_tokens=2, n=2, ignore_eos=True))
    out = sched.schedule()
    assert new_chunks(out) == [("many", 8)]
    deltas += list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert {i: len(t) for i, t in tokens_by_sample(d for d in deltas if d.request_id == "many").items()} == {0: 2, 1: 2}
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("num_gpu_blocks, starts", [(7, True), (6, False)])
def test_a_hybrid_request_beside_another_takes_a_block_in_each_table_and_keeps_one_per_table_for_it(
        num_gpu_blocks, starts):
    # "a" holds a global and a local block; "b" takes the same, and keeps 2 free for "a": 4 of 6 usable (of 7)
    sched, worker = scheduler(num_window_groups=1, hybrid_window=4, num_gpu_blocks=num_gpu_blocks, max_model_len=12)
    sched.add_request(request("a", [10, 11, 12], max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    deltas = list(sched.update_from_output(out, worker.step(out)))
    sched.add_request(request("b", [20, 21, 22], max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    assert new_chunks(out) == ([("b", 3)] if starts else [])
    deltas += list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    assert {rid: len(tokens) for rid, tokens in tokens_by_request(deltas).items()} == {"a": 2, "b": 2}
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("num_gpu_blocks, starts_at_once", [(6, True), (5, False)])
def test_a_windowed_request_arriving_beside_forked_samples_keeps_room_for_each_samples_window(
        num_gpu_blocks, starts_at_once):
    # window 4 in blocks of 4: each sample holds at most 2 blocks; 5 usable of 6 hold both samples' and b's
    # next blocks; with 4 usable b waits for the samples to end
    sched, worker = scheduler(sliding_window=4, num_gpu_blocks=num_gpu_blocks, max_num_seqs=8)
    sched.add_request(request("p", [10, 11, 12, 13, 14], max_tokens=8, n=2, ignore_eos=True))
    deltas = []
    for _ in range(3):  # the shared prompt, then the two samples decoding
        out = sched.schedule()
        deltas += sched.update_from_output(out, worker.step(out))
    sched.add_request(request("b", [20, 21, 22], max_tokens=8, ignore_eos=True))
    out = sched.schedule()
    assert new_chunks(out) == ([("b", 3)] if starts_at_once else [])
    deltas += list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    samples = tokens_by_sample(d for d in deltas if d.request_id == "p")
    assert sorted(len(tokens) for tokens in samples.values()) == [8, 8]
    assert_all_blocks_free(sched)
