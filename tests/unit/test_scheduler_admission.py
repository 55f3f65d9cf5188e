"""Admission's rules at their edges (scheduler_proc/admission.py, pure functions): the largest
request that fits is accepted, one token or block more is refused with a message that names
the numbers."""

from __future__ import annotations

import pytest

import msgspec

from pagedserve.protocol.messages import LoRAAdapter
from pagedserve.protocol.sampling_params import StructuredOutputs
from pagedserve.scheduler_proc.admission import NewRequestVerdict, judge_new, length_limit, rejection_reason
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done


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
