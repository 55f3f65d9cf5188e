"""The stop rules and the step-result checks of scheduler_proc/output_processor.py at their edges,
on the first sampled token (the per-sequence path) and in the decode lane (the array path)."""

from __future__ import annotations

import msgspec
import pytest

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.output_processor import StepResultMismatch
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import (EOS, SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done,
                                   scripted, step_clock)


def make(next_token) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(debug_invariants=True)
    return Scheduler(config), SimWorker(config, next_token)


@pytest.mark.parametrize("stop_at", [1, 2, 5])  # 1: the first token; later ones: in the decode lane
def test_a_stop_token_exactly_at_min_tokens_stops_the_request(stop_at):
    sched, worker = make(scripted(*([7] * (stop_at - 1)), EOS))
    sched.add_request(request("r", [4, 5, 6], max_tokens=10, min_tokens=stop_at))
    deltas = run_until_done(sched, worker)
    assert [t for d in deltas for t in d.new_token_ids] == [7] * (stop_at - 1) + [EOS]
    last = deltas[-1]
    assert (last.finish_reason, last.stop_token_id) == ("stop", EOS)
    assert all((d.num_prompt_tokens, d.num_cached_tokens) == (3, 0) for d in (deltas[0], last))
    assert_all_blocks_free(sched)


def test_a_request_with_many_stop_ids_stops_on_any_of_them_in_the_decode_lane():
    stop_ids = list(range(2000, 2012))
    sched, worker = make(scripted(7, 8, 9, 2011))
    sched.add_request(request("r", [4, 5, 6], max_tokens=10, stop_token_ids=stop_ids))
    sched.add_request(request("other", [4, 5, 6, 1], max_tokens=6, ignore_eos=True))
    deltas = run_until_done(sched, worker)
    mine = [d for d in deltas if d.request_id == "r"]
    assert [t for d in mine for t in d.new_token_ids] == [7, 8, 9, 2011]
    assert (mine[-1].finish_reason, mine[-1].stop_token_id) == ("stop", 2011)
    assert_all_blocks_free(sched)


def steps_until_the_lane_decodes(sched, worker):
    """Steps until a SchedulerOutput carries decode-lane entries; returns it, not yet answered."""
    for _ in range(20):
        out = sched.schedule()
        if out.decodes.req_ids:
            return out
        sched.update_from_output(out, worker.step(out))
    raise AssertionError("no decode lane step")


def lane_scheduler():
    sched, worker = make(counting_tokens())
    for rid in ("a", "b"):
        sched.add_request(request(rid, [4, 5, 6], max_tokens=10))
    return sched, worker


def test_a_result_with_a_token_too_few_is_refused_naming_the_counts():
    sched, worker = lane_scheduler()
    out = steps_until_the_lane_decodes(sched, worker)
    result = worker.step(out)
    short = msgspec.structs.replace(result, sampled_token_ids=result.sampled_token_ids[:-1])
    with pytest.raises(StepResultMismatch, match=f"step {out.step} scheduled 2 sampling sequences, the result "
                                                 f"has 2 ids and 1 tokens"):
        sched.update_from_output(out, short)


@pytest.mark.parametrize("where", ["first samples", "decode lane"])
def test_samples_in_the_wrong_order_are_refused_naming_the_sample_and_the_one_due(where):
    sched, worker = lane_scheduler()
    # the first step holds both prompts, each ending with its first sample (the per-sequence path)
    out = sched.schedule() if where == "first samples" else steps_until_the_lane_decodes(sched, worker)
    result = worker.step(out)
    first, second = result.req_ids
    swapped = msgspec.structs.replace(result, req_ids=[second, first])
    with pytest.raises(StepResultMismatch, match=f"step {out.step}: a sample for '{second}' where '{first}' was due"):
        sched.update_from_output(out, swapped)


@pytest.mark.parametrize("field", ["logprobs", "top_logprobs"])
def test_a_result_with_a_logprob_too_few_is_refused_naming_the_counts(field):
    sched, worker = lane_scheduler()
    out = steps_until_the_lane_decodes(sched, worker)
    result = msgspec.structs.replace(worker.step(out), **{field: [0.0] if field == "logprobs" else [[]]})
    with pytest.raises(StepResultMismatch, match=f"step {out.step}: 1 {field} for 2 tokens"):
        sched.update_from_output(out, result)


def test_a_request_aborted_while_its_step_ran_gets_no_token_and_the_others_still_do():
    sched, worker = lane_scheduler()
    out = sched.schedule()  # both prompts, each ending with its first sample
    result = worker.step(out)
    first, second = result.req_ids
    sched.abort_requests([first])
    deltas = list(sched.update_from_output(out, result))
    assert [(d.request_id, len(d.new_token_ids)) for d in deltas] == [(second, 1)]
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_parallel_samples_fork_after_their_prompt_even_when_an_earlier_prompt_was_aborted_meanwhile():
    sched, worker = make(counting_tokens())
    for rid in ("a", "b"):
        sched.add_request(request(rid, [4, 5, 6, 7, 8], max_tokens=2, n=2))
    out = sched.schedule()  # both parents compute prompt[:-1]; nobody samples yet
    result = worker.step(out)
    sched.abort_requests(["a"])
    sched.update_from_output(out, result)
    out = sched.schedule()
    assert sorted(r.req_id for r in out.new_requests) == ["b/0", "b/1"]
    sched.update_from_output(out, worker.step(out))
    run_until_done(sched, worker)
    assert_all_blocks_free(sched)


def test_reading_a_result_changes_no_sequence_until_the_scheduler_applies_it():
    """One writer: ``read_samples`` decides (tokens kept, ends, deltas) and only the scheduler appends."""
    from pagedserve.scheduler_proc.output_processor import read_samples

    sched, worker = make(scripted(7, EOS))
    sched.add_request(request("r", [4, 5, 6], max_tokens=10))
    out = sched.schedule()
    seq = sched.requests["r"].sequences[0]
    assert (list(seq.token_ids), seq.num_kv_tokens) == ([4, 5, 6], 3)  # the plan applied once built
    result = worker.step(out)
    sampled = read_samples(out, result, [seq], [])
    assert [(s, tokens) for s, tokens, _ in sampled.appended] == [(seq, [7])] and not sampled.ended
    assert list(seq.token_ids) == [4, 5, 6]  # decided, not yet applied
    sched.update_from_output(out, result)
    assert list(seq.token_ids) == [4, 5, 6, 7]


def test_planning_a_step_changes_no_sequence_until_the_scheduler_applies_the_plan():
    """One writer: ``StepPlan.add`` records the wire entry; the counters move in ``_finish_step``."""
    from pagedserve.scheduler_proc.step import StepPlan

    sched, worker = make(counting_tokens())
    sched.add_request(request("r", [4, 5, 6], max_tokens=10))
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))  # one token sampled: a decode the workers hold
    seq = sched.requests["r"].sequences[0]
    before = (seq.num_kv_tokens, seq.num_tokens_sent, seq.num_blocks_sent, seq.worker_knows, list(seq.token_ids))
    plan = StepPlan(100)
    plan.add(seq, 1)
    assert (seq.num_kv_tokens, seq.num_tokens_sent, seq.num_blocks_sent, seq.worker_knows,
            list(seq.token_ids)) == before
    [entry] = plan.cached
    assert (entry.new_token_ids, entry.num_computed_tokens, entry.num_scheduled_tokens) == ([seq.token_ids[-1]], 3, 1)
    assert plan.scheduled == [(seq, 1)] and plan.budget == 99


def test_building_the_steady_decodes_batch_changes_no_progress_until_the_scheduler_applies_the_plan():
    """One writer for the decode lane too: its batch is read from the columns, and a steady decode's
    progress moves only when the scheduler applies the step (``_update_after_schedule``)."""
    sched, worker = lane_scheduler()
    out = steps_until_the_lane_decodes(sched, worker)
    sched.update_from_output(out, worker.step(out))
    seqs = sched.running_sequences()
    before = [(s.num_kv_tokens, s.num_tokens_sent, len(s.token_ids)) for s in seqs]
    built = sched.running.steady_batch()
    assert sched.running.steady_batch() == built  # building it again gives the same batch
    assert [(s.num_kv_tokens, s.num_tokens_sent, len(s.token_ids)) for s in seqs] == before
    out = sched.schedule()
    assert out.decodes.num_computed_tokens == built.num_computed_tokens
    assert [s.num_kv_tokens for s in seqs] == [kv + 1 for kv, _, _ in before]


def test_a_speculator_says_what_it_wants_and_the_scheduler_cuts_it_to_the_blocks_it_can_spare():
    """Speculation asks nothing of the block manager: ``propose`` returns every proposal it wants,
    and the step carries only those the scheduler found blocks for, one block left free for each
    later sequence of the step."""
    from pagedserve.protocol.speculative import SpeculativeConfig

    wanted = [1007, 1008, 1009, 1010]

    class Fixed:
        def propose(self, tokens, most: int) -> list[int]:
            return wanted[:most]

    config = SchedulerConfig(block_size=4, num_gpu_blocks=5, max_num_seqs=2, max_num_batched_tokens=32,
                             speculative=SpeculativeConfig("ngram", 4, 4, 1), debug_invariants=True)
    sched = Scheduler(config, proposer=Fixed(), clock=step_clock())  # every step's cost alike: all 4 pay
    for name in ("a", "b"):  # 7-token prompts: 2 blocks each, 1 left
        sched.add_request(request(name, list(range(10, 17)), max_tokens=10, ignore_eos=True))
    worker = SimWorker(config, counting_tokens())
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    a = sched.requests["a"].sequences[0]
    assert sched.speculator.propose(a, 32) == wanted  # the whole wish, whatever the cache holds
    out = sched.schedule()
    assert "a" not in out.spec_token_ids  # "b", later in the step, may need the last block
    assert out.spec_token_ids["b"] == wanted
