"""Speculative decoding in the scheduler, with pure objects: proposals get slots only from blocks
nobody else in the step needs, the blocks of rejected ones are free again after the same step's
update, fresh blocks are zeroed before a proposal first writes them, and every token streams
exactly once, in order, never past a stop or ``max_tokens``, with speculation on.

The simulated worker (support/scheduler_sim.py) verifies proposals as the real one does:
position by position, accepting while the token it would sample equals the proposal. Tokens
count positions (output i of a p-token prompt is 1000 + p + i), so a proposer can be right,
wrong or partly right on purpose.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedserve.protocol.speculative import SpeculativeConfig
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler as _Scheduler
from pagedserve.scheduler_proc.speculation import GIVE_UP_AFTER, NgramProposer

from support.scheduler_sim import (EOS, SimWorker, StepDriver, assert_all_blocks_free, counting_tokens, request,
                                   step_clock)

from test_scheduler_workload_properties import aborts, arrivals, run_workload

K = 4


def Scheduler(config: SchedulerConfig, **kwargs) -> _Scheduler:
    """Every step's cycle alike (step_clock), so the measured cost of a proposal, and with it
    every decision below, is the same on any machine."""
    return _Scheduler(config, clock=kwargs.pop("clock", None) or step_clock(), **kwargs)


def spec_config(**overrides) -> SchedulerConfig:
    settings = dict(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                    debug_invariants=True, speculative=SpeculativeConfig("ngram", K, 4, 1))
    settings.update(overrides)
    return SchedulerConfig(**settings)


class CountingGuess:
    """Proposes the counting tokens that come next, the first ``right`` of them correct (None:
    all), the rest off by one; ``calls`` records each proposal."""

    def __init__(self, right=None, rng=None):
        self.right, self.rng, self.calls = right, rng, []

    def propose(self, tokens, max_tokens: int) -> list[int]:
        right = self.rng.randint(0, max_tokens) if self.rng is not None else self.right
        right = max_tokens if right is None else right
        out = [1000 + len(tokens) + j + (j >= right) for j in range(max_tokens)]
        self.calls.append(out)
        return out


def run(sched: Scheduler, worker: SimWorker, ahead: bool = False, on_step=None, max_steps: int = 2000):
    driver = StepDriver(sched, worker, ahead)
    streams: dict = {}
    finishes: dict = {}
    for _ in range(max_steps):
        if not driver.busy():
            return streams, finishes
        out, result, deltas = driver.step()
        if on_step is not None:
            on_step(out, result)
        for d in deltas:
            assert (d.request_id, d.index) not in finishes, f"{d.request_id} streamed after its end"
            streams.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
            if d.finish_reason:
                finishes[(d.request_id, d.index)] = d.finish_reason
    raise AssertionError("not finished")


def test_right_proposals_finish_in_fewer_steps_with_the_same_tokens():
    plain = Scheduler(spec_config(speculative=None))
    plain.add_request(request("r", [5, 6, 7], max_tokens=40, ignore_eos=True))
    want, _ = run(plain, SimWorker(plain.config, counting_tokens()))
    sched = Scheduler(spec_config(), proposer=CountingGuess())
    sched.add_request(request("r", [5, 6, 7], max_tokens=40, ignore_eos=True))
    steps = []
    got, finishes = run(sched, SimWorker(sched.config, counting_tokens()), on_step=lambda out, res: steps.append(out))
    assert got == want and finishes == {("r", 0): "length"}
    assert len(got[("r", 0)]) == 40
    assert len(steps) < 40 // 2  # up to K + 1 tokens a step
    stats = sched.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["generation_tokens"] == 40
    assert_all_blocks_free(sched)


def test_a_rejected_proposal_frees_its_blocks_in_the_same_step_and_a_block_handed_out_again_is_zeroed_again():
    sched = Scheduler(spec_config(), proposer=CountingGuess(right=0))
    sched.add_request(request("r", list(range(10, 17)), max_tokens=20, ignore_eos=True))  # 7 tokens
    worker = SimWorker(sched.config, counting_tokens())
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))  # the prompt; its first token sampled
    free_before = sched.bm.device.num_free
    (seq,) = sched.running_sequences()
    out = sched.schedule()
    # its token at position 7 (block 1) and 4 proposals at 8..11: block 2, only for proposals
    assert out.spec_token_ids == {"r": [1009, 1010, 1011, 1012]} and seq.spec.drafts == out.spec_token_ids["r"]
    assert sched.bm.device.num_free == free_before - 1 and out.new_block_ids_to_zero == seq.block_ids[2:]
    proposal_block = seq.block_ids[2]
    result = worker.step(out)
    assert result.num_accepted_tokens == {"r": 0} and result.sampled_token_ids == [1008]
    sched.update_from_output(out, result)
    assert seq.num_kv_tokens == 8 and len(seq.token_ids) == 9
    assert proposal_block not in seq.block_ids and sched.bm.device.num_free == free_before
    sched.check_invariants()
    out = sched.schedule()  # position 8 starts a block: handed out fresh, so listed for zeroing again
    assert seq.block_ids[2] in out.new_block_ids_to_zero
    sched.update_from_output(out, worker.step(out))
    run(sched, worker)
    assert_all_blocks_free(sched)


def test_proposals_leave_a_free_block_for_every_later_sequence_of_the_step_and_never_preempt():
    # 5 blocks of 4: two 7-token prompts take 2 blocks each, one is left. The older sequence's
    # proposals (from position 8 on) would need it while a later sequence might: none; the
    # later one, last in the step, may take it.
    sched = Scheduler(spec_config(num_gpu_blocks=5, max_num_seqs=2), proposer=CountingGuess())
    for name in ("a", "b"):
        sched.add_request(request(name, list(range(10, 17)), max_tokens=10, ignore_eos=True))
    worker = SimWorker(sched.config, counting_tokens())
    out = sched.schedule()
    sched.update_from_output(out, worker.step(out))
    out = sched.schedule()
    assert list(out.spec_token_ids) == ["b"] and len(out.spec_token_ids["b"]) == K
    assert sched.bm.device.num_free == 0
    assert sched.stats()["num_preemptions_recompute"] + sched.stats()["num_preemptions_swap"] == 0
    sched.update_from_output(out, worker.step(out))
    streams, _ = run(sched, worker)
    assert_all_blocks_free(sched)


def test_proposals_stop_at_the_end_of_a_cache_the_sequence_fills():
    # 3 blocks of 4 and a 9-token prompt: the sequence may hold 13 tokens (12 computed + the
    # last sampled), so after its first token only 2 proposals fit, and the cache's limit ends it
    sched = Scheduler(spec_config(num_gpu_blocks=3, max_num_seqs=1), proposer=CountingGuess())
    sched.add_request(request("r", list(range(10, 19)), max_tokens=6, ignore_eos=True))
    proposals = []
    streams, finishes = run(sched, SimWorker(sched.config, counting_tokens()),
                            on_step=lambda out, res: proposals.append(out.spec_token_ids.get("r", [])))
    assert proposals == [[], [1010, 1011]]
    assert streams[("r", 0)] == [1009, 1010, 1011, 1012] and finishes[("r", 0)] == "length"
    assert_all_blocks_free(sched)


def test_nothing_streams_past_max_tokens_or_a_stop_among_accepted_proposals():
    def eos_at_12(req_id, tokens):
        return EOS if len(tokens) == 12 else 1000 + len(tokens)

    class Right:
        def propose(self, tokens, max_tokens):
            return [eos_at_12("", list(tokens) + [0] * j) for j in range(max_tokens)]

    sched = Scheduler(spec_config(), proposer=Right())
    sched.add_request(request("stops", [1, 2, 3, 4, 5, 6], max_tokens=50))
    sched.add_request(request("long", [1, 2, 3], max_tokens=7, ignore_eos=True))
    streams, finishes = run(sched, SimWorker(sched.config, eos_at_12))
    assert streams[("stops", 0)] == [1006, 1007, 1008, 1009, 1010, 1011, EOS]
    assert finishes[("stops", 0)] == "stop"
    assert streams[("long", 0)] == [1003, 1004, 1005, 1006, 1007, 1008, 1009]
    assert finishes[("long", 0)] == "length"
    assert_all_blocks_free(sched)


def test_requests_with_logprobs_or_parents_never_speculate_and_children_do():
    guess = CountingGuess()
    sched = Scheduler(spec_config(max_num_seqs=8), proposer=guess)
    sched.add_request(request("lp", [1, 2, 3], max_tokens=6, logprobs=True, ignore_eos=True))
    sched.add_request(request("n3", [4, 5, 6, 7], max_tokens=9, n=3, ignore_eos=True, temperature=1.0))
    drafted = set()
    streams, _ = run(sched, SimWorker(sched.config, counting_tokens()),
                     on_step=lambda out, res: drafted.update(out.spec_token_ids))
    assert drafted == {"n3/0", "n3/1", "n3/2"}
    assert all(streams[("n3", i)] == [1004 + j for j in range(9)] for i in range(3))
    assert_all_blocks_free(sched)


def test_a_sequence_whose_proposals_fail_stops_proposing_and_joins_the_decode_lane():
    sched = Scheduler(spec_config(), proposer=CountingGuess(right=0))
    sched.add_request(request("r", [5, 6, 7], max_tokens=200, ignore_eos=True))
    driver = StepDriver(sched, SimWorker(sched.config, counting_tokens()), ahead=True)
    steps_with_proposals = 0
    while driver.busy():
        out, _, _ = driver.step()
        steps_with_proposals += bool(out.spec_token_ids)
    # K, then fewer as the measured acceptance falls (spec_cost.worth_proposing); two misses in a
    # row pause it for 1, 2, 4, ... steps; off for good once GIVE_UP_AFTER proposals were
    # verified with none accepted
    stats = sched.stats()
    assert stats["spec_decode_num_accepted_tokens"] == 0
    assert GIVE_UP_AFTER <= stats["spec_decode_num_draft_tokens"] < GIVE_UP_AFTER + K
    assert steps_with_proposals < GIVE_UP_AFTER - K
    assert driver.steps_ahead > 100  # in the decode lane, async scheduling overlaps its steps again


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("name,overrides", [
    ("tight-swap", dict(num_gpu_blocks=20, num_cpu_blocks=12, preemption_mode="swap", max_num_seqs=6)),
    ("tight-recompute", dict(num_gpu_blocks=16, preemption_mode="recompute", max_num_seqs=6)),
    ("prefix-cache", dict(num_gpu_blocks=40, num_cpu_blocks=8, enable_prefix_caching=True, max_num_seqs=6)),
    ("block-size-1", dict(block_size=1, num_gpu_blocks=120, enable_prefix_caching=True, max_num_seqs=6)),
])
def test_mixed_workloads_with_partly_right_proposals_stream_every_token_once(name, overrides, ahead):
    rng = random.Random(hash(name) % 1000)
    sched = Scheduler(spec_config(**overrides), proposer=CountingGuess(rng=rng))
    run_mixed_workload(sched, SimWorker(sched.config, counting_tokens()), ahead)


def run_mixed_workload(sched: Scheduler, worker: SimWorker, ahead: bool) -> None:
    """Twelve requests, some sharing a prefix, n = 2 among them: each streams its counting tokens once."""
    prompts = {}
    for i in range(12):
        prompts[f"r{i}"] = ([9] * 8 if i % 3 == 0 else []) + [20 + (i * 7 + j) % 50 for j in range(2 + i % 9)]
        sched.add_request(request(f"r{i}", prompts[f"r{i}"], max_tokens=3 + (i * 5) % 23, n=1 + (i % 5 == 4),
                                  ignore_eos=True))
    streams, finishes = run(sched, worker, ahead=ahead)
    for (request_id, index), got in streams.items():
        p = len(prompts[request_id])
        assert got == [1000 + p + j for j in range(len(got))], (request_id, index)
        assert finishes[(request_id, index)] == "length"
    stats = sched.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_all_blocks_free(sched)


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    from array import array

    proposer = NgramProposer(1, 3)
    assert proposer.propose(array("q", [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]), 3) == [8, 5, 2]
    assert proposer.propose(array("q", [7, 1, 2, 7, 1, 2, 7]), 5) == [1, 2, 7, 1, 2]  # through its own proposals
    assert proposer.propose(array("q", [1, 2, 3, 4]), 2) == []
    assert NgramProposer(2, 2).propose(array("q", [4, 5, 6, 5]), 2) == []  # a 1-token match is too short


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A step scheduled ahead held r5/0's proposals when the step before's result named its blocks:
# the prefix cache once named positions not yet verified ("names more blocks than it has computed").
@example(block_size=2, num_gpu_blocks=29, num_cpu_blocks=0, max_num_seqs=3, prefix_caching=True,
         workload=[(17, False, [21, 42, 40, 84, 60, 74, 37, 80, 53, 38], 124, 1), (12, False, [75, 34], 65, 2),
                   (20, False, [86, 73, 20, 67, 51, 80], 129, 2), (15, True, [18, 47, 44, 19, 44], 129, 2),
                   (11, False, [25, 76, 60, 37, 75], 6, 2), (29, False, [42, 52, 78, 70], 155, 2)],
         abort_plan=[], ahead=True, seed=163, k=3)
@given(block_size=st.sampled_from([1, 2, 4, 16]), num_gpu_blocks=st.integers(12, 60),
       num_cpu_blocks=st.sampled_from([0, 8, 40]), max_num_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), workload=arrivals, abort_plan=aborts, ahead=st.booleans(),
       seed=st.integers(0, 1000), k=st.integers(1, 6))
def test_the_random_workloads_deliver_every_token_once_in_order_with_speculation(
        block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs, prefix_caching, workload, abort_plan, ahead, seed, k):
    # the random workloads of test_scheduler_workload_properties.py (arrivals, aborts while a step
    # is out, swaps, recomputes, forks, prefix hits), every decode proposing partly right tokens
    run_workload(SchedulerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                 max_num_seqs=max_num_seqs, max_num_batched_tokens=max(16, max_num_seqs),
                                 max_model_len=160, enable_prefix_caching=prefix_caching, debug_invariants=True,
                                 speculative=SpeculativeConfig("ngram", k, 4, 1)),
                 workload, abort_plan, ahead, proposer=CountingGuess(rng=random.Random(seed)))


def test_the_flag_takes_vllms_json_and_refuses_what_cannot_run_in_one_line():
    from pagedserve.deploy.vllm_compat import unsupported_flag
    from pagedserve.runtime import options as opts
    from pagedserve.protocol.speculative import parse_speculative_config

    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}') == \
        SpeculativeConfig("ngram", 4, 4, 4)  # vLLM's rule: one bound given, the other equals it
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 5, 5)
    assert unsupported_flag(["--speculative-config", "{}"]) is None
    for value, words in (('{"method": "eagle", "num_speculative_tokens": 2}', "EAGLE"),
                         ('{"method": "mtp", "num_speculative_tokens": 1}', "MTP"),
                         ('{"method": "draft_model", "num_speculative_tokens": 4}', "model"),
                         ('{"model": "/m", "num_speculative_tokens": 4, "prompt_lookup_max": 2}', "prompt_lookup_max"),
                         ('{"method": "ngram"}', "num_speculative_tokens is required"),
                         ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                         ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
                          '"prompt_lookup_max": 2}', "exceeds"),
                         ("ngram", "not JSON")):
        with pytest.raises(opts.OptionError, match=words) as refused:
            opts.validate({"speculative_config": value})
        assert "\n" not in str(refused.value) and str(refused.value).startswith("--speculative-config")


def test_a_sequence_with_nothing_to_propose_joins_the_decode_lane_after_32_decodes():
    from pagedserve.scheduler_proc.speculation import GIVE_UP_UNMATCHED

    sched = Scheduler(spec_config())  # prompt lookup: counting tokens never repeat
    sched.add_request(request("r", [5, 6, 7], max_tokens=120, ignore_eos=True))
    driver = StepDriver(sched, SimWorker(sched.config, counting_tokens()), ahead=True)
    while driver.busy():
        out, _, _ = driver.step()
        assert not out.spec_token_ids
    assert driver.steps_ahead > 120 - GIVE_UP_UNMATCHED - 10  # overlapped once it stopped looking
    assert_all_blocks_free(sched)
