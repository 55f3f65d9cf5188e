"""Speculative decoding with a draft model (``draft_model``), the scheduler's half, with pure
objects: the proposals the worker's draft returns after a step are the next step's proposals,
trimmed by the same room, ``max_tokens`` and cache rules as prompt lookup's; rejected ones give
their blocks back in the same update; the draft runs over every step of a speculating sequence
and over nothing of one that stopped; and the config is read, or refused in one line.

The simulated worker (support/scheduler_sim.py) drafts with a ``drafter`` function: tokens count
positions (output i of a p-token prompt is 1000 + p + i), so a draft can be right or wrong on purpose.
"""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.protocol.speculative import (SpeculativeConfig, SpeculativeConfigError, check_draft_model,
                                             parse_speculative_config)
from pagedserve.scheduler_proc.speculation import GIVE_UP_AFTER

from support.scheduler_sim import SimWorker, StepDriver, assert_all_blocks_free, counting_tokens, request

from test_scheduler_speculation import K, Scheduler, run, run_mixed_workload, spec_config

DRAFT = SpeculativeConfig("draft_model", K, 0, 0, model="/draft")


def draft_config(**overrides):
    return spec_config(**{"speculative": DRAFT, **overrides})


def counting_draft(right=None, rng=None):
    """A drafter whose first ``right`` proposals (None: all; with ``rng``: a random count) are the
    counting tokens that come next, the rest off by one."""
    def drafter(req_id, tokens, k):
        r = rng.randint(0, k) if rng is not None else (k if right is None else right)
        return [1000 + len(tokens) + j + (j >= r) for j in range(k)]
    return drafter


def test_the_drafts_of_a_step_are_the_next_steps_proposals_with_the_same_tokens_in_fewer_steps():
    plain = Scheduler(draft_config(speculative=None))
    plain.add_request(request("r", [5, 6, 7], max_tokens=40, ignore_eos=True))
    want, _ = run(plain, SimWorker(plain.config, counting_tokens()))
    sched = Scheduler(draft_config())
    sched.add_request(request("r", [5, 6, 7], max_tokens=40, ignore_eos=True))
    steps = []
    got, _ = run(sched, SimWorker(sched.config, counting_tokens(), drafter=counting_draft()),
                 on_step=lambda out, res: steps.append((out, res)))
    assert got == want and len(got[("r", 0)]) == 40
    assert len(steps) < 40 // 2
    for (_, before), (out, _) in zip(steps, steps[1:]):
        proposed = out.spec_token_ids.get("r", [])
        assert proposed == before.draft_token_ids.get("r", [])[:len(proposed)]
    assert sum(bool(out.spec_token_ids) for out, _ in steps) >= 5  # plain steps price a row meanwhile (spec_cost.py)
    stats = sched.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert_all_blocks_free(sched)


def test_drafts_are_trimmed_to_max_tokens_and_to_a_cache_the_sequence_fills():
    sched = Scheduler(draft_config())
    sched.add_request(request("r", [5, 6, 7], max_tokens=7, ignore_eos=True))
    proposals = []
    streams, finishes = run(sched, SimWorker(sched.config, counting_tokens(), drafter=counting_draft()),
                            on_step=lambda out, res: proposals.append(out.spec_token_ids.get("r", [])))
    # 1 token after the prompt, 4 accepted + 1, then only the 7th output is left: no proposal
    assert proposals == [[], [1004, 1005, 1006, 1007], []]
    assert streams[("r", 0)] == [1003 + j for j in range(7)] and finishes[("r", 0)] == "length"
    # 3 blocks of 4 and a 9-token prompt: 13 tokens fit, so after the first token only 2 proposals
    sched = Scheduler(draft_config(num_gpu_blocks=3, max_num_seqs=1))
    sched.add_request(request("r", list(range(10, 19)), max_tokens=6, ignore_eos=True))
    proposals = []
    streams, finishes = run(sched, SimWorker(sched.config, counting_tokens(), drafter=counting_draft()),
                            on_step=lambda out, res: proposals.append(out.spec_token_ids.get("r", [])))
    assert proposals == [[], [1010, 1011]]
    assert streams[("r", 0)] == [1009, 1010, 1011, 1012] and finishes[("r", 0)] == "length"
    assert_all_blocks_free(sched)


def test_a_rejected_draft_frees_its_blocks_in_the_same_update():
    sched = Scheduler(draft_config())
    sched.add_request(request("r", list(range(10, 17)), max_tokens=20, ignore_eos=True))  # 7 tokens
    worker = SimWorker(sched.config, counting_tokens(), drafter=counting_draft(right=0))
    out = sched.schedule()
    result = worker.step(out)
    assert out.draft_tokens == {"r": K} and result.draft_token_ids == {"r": [1009, 1010, 1011, 1012]}
    sched.update_from_output(out, result)
    free_before = sched.bm.device.num_free
    (seq,) = sched.running_sequences()
    out = sched.schedule()  # its token at position 7 (block 1), the drafts at 8..11: block 2
    assert out.spec_token_ids == {"r": [1009, 1010, 1011, 1012]}
    proposal_block = seq.block_ids[2]
    result = worker.step(out)
    assert result.num_accepted_tokens == {"r": 0} and result.sampled_token_ids == [1008]
    sched.update_from_output(out, result)
    assert proposal_block not in seq.block_ids and sched.bm.device.num_free == free_before
    sched.check_invariants()
    run(sched, worker)
    assert_all_blocks_free(sched)


def test_the_draft_runs_over_every_step_of_a_speculating_sequence_and_nothing_once_it_stopped():
    # a 20-token prompt in chunks of 8: the draft computes every chunk; "lp" asks for logprobs
    # and never speculates; "r"'s drafts are always wrong, so it stops for good
    sched = Scheduler(draft_config(max_num_batched_tokens=8))
    sched.add_request(request("r", list(range(10, 30)), max_tokens=120, ignore_eos=True))
    sched.add_request(request("lp", [1, 2, 3], max_tokens=4, logprobs=True, ignore_eos=True))
    driver = StepDriver(sched, SimWorker(sched.config, counting_tokens(), drafter=counting_draft(right=0)),
                        ahead=True)
    asked = []
    while driver.busy():
        out, _, _ = driver.step()
        scheduled = {r.req_id for r in out.new_requests} | {r.req_id for r in out.cached_requests}
        asked.append((scheduled, out.draft_tokens))
    assert all("lp" not in wanted for _, wanted in asked)
    assert [set(wanted) for scheduled, wanted in asked[:3]] == [{"r"}] * 3  # chunks of 8, 8, 4
    assert [wanted["r"] for _, wanted in asked[:2]] == [K, K]
    stopped = next(i for i, (scheduled, wanted) in enumerate(asked) if "r" not in wanted)
    assert all(not wanted for _, wanted in asked[stopped:])  # no draft work once it stopped
    assert sched.stats()["spec_decode_num_accepted_tokens"] == 0
    assert 0 < sched.stats()["spec_decode_num_draft_tokens"] < GIVE_UP_AFTER + K
    assert driver.steps_ahead > 60  # in the decode lane, overlapped again
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("overrides", [
    dict(num_gpu_blocks=20, num_cpu_blocks=12, preemption_mode="swap", max_num_seqs=6),
    dict(num_gpu_blocks=16, preemption_mode="recompute", max_num_seqs=6),
    dict(num_gpu_blocks=40, num_cpu_blocks=8, enable_prefix_caching=True, max_num_seqs=6),
])
def test_mixed_workloads_with_partly_right_drafts_stream_every_token_once(overrides, ahead):
    sched = Scheduler(draft_config(**overrides))
    drafter = counting_draft(rng=random.Random(len(overrides) + ahead))
    run_mixed_workload(sched, SimWorker(sched.config, counting_tokens(), drafter=drafter), ahead)


def _model(path, vocab_size: int):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return str(path)


def test_vllms_draft_model_config_is_read_and_what_cannot_run_is_refused_in_one_line(tmp_path):
    from pagedserve.runtime import options as opts

    target, draft, other = (_model(tmp_path / n, v) for n, v in (("t", 512), ("d", 512), ("o", 1000)))
    spec = parse_speculative_config(json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3}))
    assert spec == SpeculativeConfig("draft_model", 3, 0, 0, model=draft)
    assert parse_speculative_config({"model": draft, "num_speculative_tokens": 3}) == spec  # vLLM: no method
    assert parse_speculative_config(spec.to_json()) == spec
    check_draft_model(spec, target, tensor_parallel_size=1)
    refusals = [(lambda: check_draft_model(spec, target, tensor_parallel_size=2), "--tensor-parallel-size"),
                (lambda: check_draft_model(parse_speculative_config({"model": other, "num_speculative_tokens": 3}),
                                           target, 1), "model .* vocabulary of 1000"),
                (lambda: check_draft_model(parse_speculative_config({"model": str(tmp_path / "none"),
                                                                     "num_speculative_tokens": 3}), target, 1),
                 "model .*no config.json"),
                (lambda: opts.validate({"speculative_config": '{"method": "draft_model", "num_speculative_tokens": 2}'}),
                 "model")]
    for refuse, words in refusals:
        with pytest.raises((SpeculativeConfigError, opts.OptionError), match=words) as refused:
            refuse()
        assert "\n" not in str(refused.value) and str(refused.value).startswith("--speculative-config")
