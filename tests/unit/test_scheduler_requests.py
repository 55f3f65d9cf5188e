"""Request lifecycle: validation, stop rules, aborts, parallel sampling, failure recovery."""

from __future__ import annotations

import pytest

from pagedserve.protocol.messages import StepResult
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.invariants import InvariantError
from pagedserve.scheduler_proc.scheduler import Scheduler, SchedulerStateError

from support.scheduler_sim import (EOS, SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done,
                                   scripted, swap_one_out)


def make(next_token=None, **overrides) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(debug_invariants=True, **overrides)
    return Scheduler(config), SimWorker(config, next_token or counting_tokens())


def test_a_prompt_longer_than_the_model_allows_fails_at_once_naming_the_numbers():
    sched, _ = make(max_model_len=16)
    [delta] = sched.add_request(request("r", list(range(16))))
    assert (delta.finish_reason, delta.error_kind) == ("error", "invalid_request")
    assert "16 tokens" in delta.error and "max_model_len=16" in delta.error
    assert not sched.has_unfinished()


def test_a_prompt_larger_than_the_whole_cache_fails_at_once_naming_the_numbers():
    sched, _ = make(block_size=4, num_gpu_blocks=3, max_model_len=64)
    [delta] = sched.add_request(request("r", list(range(13))))
    assert delta.error_kind == "invalid_request" and "4 KV blocks" in delta.error and "only 3" in delta.error


def test_parallel_samples_that_cannot_fit_together_fail_with_one_error_per_sample():
    sched, _ = make(block_size=4, num_gpu_blocks=4, max_model_len=64)
    deltas = sched.add_request(request("r", list(range(9)), n=3))
    assert [d.index for d in deltas] == [0, 1, 2]
    assert all(d.finish_reason == "error" and "n=3" in d.error for d in deltas)


def test_eos_stops_with_the_token_included_but_not_before_min_tokens():
    sched, worker = make(next_token=scripted(EOS, 7, EOS))
    sched.add_request(request("r", [4, 5, 6], max_tokens=10, min_tokens=2))
    deltas = run_until_done(sched, worker)
    assert [d.new_token_ids for d in deltas] == [[EOS], [7], [EOS]]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_token_id == EOS
    assert deltas[0].finish_reason is None


def test_stop_token_ids_stop_even_with_ignore_eos_and_eos_does_not():
    sched, worker = make(next_token=scripted(EOS, 9, 11))
    sched.add_request(request("r", [4, 5], max_tokens=10, ignore_eos=True, stop_token_ids=[11]))
    deltas = run_until_done(sched, worker)
    assert [d.new_token_ids[0] for d in deltas] == [EOS, 9, 11]
    assert (deltas[-1].finish_reason, deltas[-1].stop_token_id) == ("stop", 11)


def test_max_tokens_and_max_model_len_end_with_length():
    sched, worker = make(max_model_len=8)
    sched.add_request(request("short", [4, 5], max_tokens=3))
    sched.add_request(request("capped", [4, 5, 6, 7, 8], max_tokens=100))
    deltas = run_until_done(sched, worker)
    ends = {d.request_id: d for d in deltas if d.finish_reason}
    assert ends["short"].finish_reason == ends["capped"].finish_reason == "length"
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "capped") == 3


def test_logprobs_are_returned_only_when_asked_for():
    sched, worker = make()
    sched.add_request(request("with", [4, 5], max_tokens=2, logprobs=True))
    sched.add_request(request("without", [4, 5], max_tokens=2))
    deltas = run_until_done(sched, worker)
    assert all(d.logprobs == [-0.5] for d in deltas if d.request_id == "with")
    assert all(d.logprobs is None for d in deltas if d.request_id == "without")


def test_an_abort_ends_the_request_and_its_blocks_are_free_and_dropped_next_step():
    sched, worker = make(block_size=4, num_gpu_blocks=16)
    sched.add_request(request("r", list(range(10)), max_tokens=50))
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    [delta] = sched.abort_requests(["r", "unknown"])
    assert (delta.request_id, delta.finish_reason) == ("r", "abort")
    assert sched.stats()["num_free_gpu_blocks"] == 16 and not sched.has_unfinished()
    out = sched.schedule()
    assert out.finished_req_ids == ["r"] and not out.new_requests and not out.cached_requests
    assert not out.decodes.req_ids
    assert sched.abort_requests(["r"]) == []


def test_an_abort_while_the_step_runs_discards_that_steps_token():
    sched, worker = make()
    sched.add_request(request("r", [1, 2, 3], max_tokens=5))
    out = sched.schedule()
    sched.abort_requests(["r"])
    assert list(sched.update_from_output(out, worker.step(out))) == []
    assert_all_blocks_free(sched)


def test_parallel_samples_share_the_prompt_blocks_and_copy_the_tail_on_first_write():
    sched, worker = make(block_size=4, num_gpu_blocks=32)
    sched.add_request(request("r", list(range(10, 20)), max_tokens=4, n=3, ignore_eos=True, seed=7))
    first = sched.schedule()  # the parent computes prompt[:-1]: 9 tokens, 3 blocks
    [parent] = first.new_requests
    assert (parent.req_id, parent.num_scheduled_tokens) == ("r", 9)
    assert list(sched.update_from_output(first, worker.step(first))) == []
    running = sched.running_sequences()
    shared = list(running[0].block_ids)
    assert all(s.block_ids == shared for s in running) and len(running) == 3
    assert [sched.bm.device.ref_counts[b] for b in shared] == [3, 3, 3]
    second = sched.schedule()
    assert second.finished_req_ids == ["r"]
    assert [r.req_id for r in second.new_requests] == ["r/0", "r/1", "r/2"]
    assert len(second.blocks_to_copy) == 2 and {src for src, _ in second.blocks_to_copy} == {shared[2]}
    assert second.new_requests[2].block_ids == shared  # the last writer keeps the original
    copies = {dst for _, dst in second.blocks_to_copy}
    assert not copies & set(second.new_block_ids_to_zero)  # zeroing would wipe the copy
    assert len({r.sampling.seed for r in second.new_requests}) == 3
    deltas = list(sched.update_from_output(second, worker.step(second)))
    assert sorted(d.index for d in deltas) == [0, 1, 2] and {d.request_id for d in deltas} == {"r"}
    deltas += run_until_done(sched, worker)
    assert sum(1 for d in deltas if d.finish_reason == "length") == 3
    assert sched.stats()["num_finished"] == 1 and sched.stats()["num_blocks_copied"] == 2
    assert_all_blocks_free(sched)


def test_unseeded_requests_get_seeds_that_depend_only_on_the_scheduler_seed():
    def seeds(config_seed):
        sched, _ = make(seed=config_seed)
        for i in range(3):
            sched.add_request(request(f"r{i}", [1, 2]))
        return [r.sampling.seed for r in sched.schedule().new_requests]
    assert seeds(1) == seeds(1) != seeds(2)
    assert all(isinstance(s, int) for s in seeds(1))
    sched, _ = make(seed=1)
    sched.add_request(request("seeded", [1, 2], seed=12345))
    assert [r.sampling.seed for r in sched.schedule().new_requests] == [12345]  # a request's own seed is kept


def test_fail_all_ends_every_request_with_an_engine_error_and_starts_fresh():
    sched, worker = make(block_size=4, num_gpu_blocks=16, num_cpu_blocks=4, enable_prefix_caching=True)
    sched.add_request(request("a", list(range(12)), max_tokens=9))
    sched.add_request(request("b", list(range(12)), max_tokens=9, n=2))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    step_before = out.step
    in_flight = sched.schedule()
    deltas = sched.fail_all("worker 0 exited with signal 9")
    assert sorted((d.request_id, d.index) for d in deltas) == [("a", 0), ("b", 0), ("b", 1)]
    assert all(d.finish_reason == "error" and d.error_kind == "engine" and "signal 9" in d.error for d in deltas)
    assert list(sched.update_from_output(in_flight, worker.step(in_flight))) == []  # written off
    assert_all_blocks_free(sched)
    assert not sched.bm.device.cache and not sched.has_unfinished()
    sched.add_request(request("c", list(range(12)), max_tokens=2))
    out = sched.schedule()
    assert out.step == step_before + 2 and out.finished_req_ids == []
    assert out.new_requests[0].num_computed_tokens == 0  # the old cache is gone


def test_scheduling_twice_without_an_update_is_refused():
    sched, _ = make()
    sched.add_request(request("r", [1, 2]))
    sched.schedule()
    with pytest.raises(SchedulerStateError):
        sched.schedule()


def test_a_result_for_another_step_is_refused():
    sched, _ = make()
    sched.add_request(request("r", [1, 2]))
    out = sched.schedule()
    with pytest.raises(ValueError, match="step"):
        sched.update_from_output(out, StepResult(step=out.step + 1, rank=0, req_ids=["r"], sampled_token_ids=[5]))


def test_the_invariant_check_names_a_corrupted_ref_count():
    sched, worker = make()
    sched.add_request(request("r", [1, 2, 3], max_tokens=4))
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    sched.bm.device.ref_counts[sched.running_sequences()[0].block_ids[0]] += 1
    with pytest.raises(InvariantError, match="ref count 2 but 1 tables"):
        sched.check_invariants()


def test_config_rejects_impossible_settings_with_a_reason():
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="evict")


def test_aborting_several_running_requests_at_once_leaves_only_the_rest_counted_running():
    sched, worker = make(block_size=4, num_gpu_blocks=32)
    for rid in ("a", "b", "c"):  # logprobs: each stays a per-object sequence, never a steady decode
        sched.add_request(request(rid, list(range(10, 16)), max_tokens=20, logprobs=1))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    assert len(sched.abort_requests(["a", "b"])) == 2
    assert sched.stats()["num_running"] == 1
    sched.check_invariants()
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_aborting_a_parent_before_it_forks_gives_back_only_the_seats_its_own_samples_held():
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=12)
    sched.add_request(request("three", list(range(10, 30)), max_tokens=4, n=3))
    sched.add_request(request("two", list(range(40, 60)), max_tokens=4, n=2))
    out = sched.schedule()  # "three" computes its prompt in chunks: it has not forked yet
    sched.update_from_output(out, worker.step(out))
    assert sched.stats()["num_running"] == 1
    sched.abort_requests(["three"])
    sched.check_invariants()  # no seat is still reserved for its samples
    deltas = run_until_done(sched, worker)
    assert sorted({(d.request_id, d.index) for d in deltas}) == [("two", 0), ("two", 1)]
    assert_all_blocks_free(sched)


def test_every_request_that_ends_counts_once_as_finished_a_shed_one_also_as_shed_and_an_abort_reports_its_usage():
    sched, worker = make(block_size=4, num_gpu_blocks=16, max_model_len=32, max_waiting_requests=1,
                         enable_prefix_caching=True)
    prompt = list(range(10, 20))
    assert sched.add_request(request("a", prompt, max_tokens=3)) == []
    [shed] = sched.add_request(request("b", [1, 2]))  # "a" waits: the limit of one is reached
    [refused] = sched.add_request(request("c", list(range(40))))  # past max_model_len
    [in_use] = sched.add_request(request("a", [1, 2]))
    assert (shed.error_kind, refused.error_kind, in_use.error_kind) == ("overloaded", "invalid_request",
                                                                       "invalid_request")
    counted = lambda: (sched.stats()["num_finished"], sched.stats()["num_requests_shed"])  # noqa: E731
    assert counted() == (3, 1)
    assert sched.step == 0
    out = sched.schedule()
    assert out.step == sched.step == 1  # steps count from 1
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)
    assert counted() == (4, 1)
    sched.add_request(request("d", prompt + [7], max_tokens=5))  # a's two full blocks are cached
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    [aborted] = sched.abort_requests(["d"])
    assert (aborted.finish_reason, aborted.num_prompt_tokens, aborted.num_cached_tokens) == ("abort", 11, 8)
    assert counted() == (5, 1)
    assert_all_blocks_free(sched)


def test_an_abort_of_a_swapped_out_request_gives_back_its_host_blocks_and_the_rest_finish():
    sched, worker = make(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, max_num_seqs=4,
                         max_num_batched_tokens=32, preemption_mode="swap")
    swapped = swap_one_out(sched, worker)
    [delta] = sched.abort_requests([swapped.request_id])
    stats = sched.stats()
    assert (delta.finish_reason, stats["num_swapped"], stats["num_free_cpu_blocks"]) == ("abort", 0, 8)
    deltas = run_until_done(sched, worker)
    assert {d.request_id for d in deltas} == {"old", "mid", "new"} - {swapped.request_id}
    assert_all_blocks_free(sched)
