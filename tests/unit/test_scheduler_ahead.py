"""Overlapped scheduling with pure objects: the scheduler builds step N+1 before step N's
result arrives (the simulated worker resolves the placeholder tokens as a real one does),
and every request streams exactly what it streams when every step waits for its result.

Tokens come from a function of (sequence, position, previous token), so both orders of
calls must give the same streams; stops are applied one step late, and nothing past a stop,
``max_tokens`` or an abort is ever streamed or counted.
"""

from __future__ import annotations

import zlib

import pytest

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler, SchedulerStateError

from support.scheduler_sim import EOS, SimWorker, StepDriver, assert_all_blocks_free, request

STOP = 7  # a stop_token_ids entry of some requests


def hashed_tokens(eos_per_mille: int):
    def next_token(req_id: str, tokens: list[int]) -> int:
        h = zlib.crc32(f"{req_id}:{len(tokens)}:{tokens[-1]}".encode())
        if h % 1000 < eos_per_mille:
            return EOS
        return STOP if h % 1000 < 2 * eos_per_mille else 10 + h % 900
    return next_token


SHARED = list(range(100, 132))


def workload(i: int):
    """Request ``i``: prompts with and without a shared prefix, n = 1..3, stop tokens, lengths."""
    prompt = (SHARED if i % 3 == 0 else []) + [20 + (i * 7 + k) % 60 for k in range(3 + (i * 5) % 17)]
    extra = {"stop_token_ids": [STOP]} if i % 4 == 1 else {}
    if i % 5 == 2:
        extra["ignore_eos"] = True
    return request(f"r{i}", prompt, max_tokens=4 + (i * 11) % 29, n=1 + (i % 7 == 3) + (i % 11 == 5), **extra)


CONFIGS = {
    "roomy": dict(block_size=4, num_gpu_blocks=400, num_cpu_blocks=0, max_num_seqs=16, max_num_batched_tokens=64),
    "tight-swap-and-recompute": dict(block_size=4, num_gpu_blocks=28, num_cpu_blocks=8, max_num_seqs=10,
                                     max_num_batched_tokens=32),
    "prefix-cache": dict(block_size=4, num_gpu_blocks=120, num_cpu_blocks=16, max_num_seqs=12,
                         max_num_batched_tokens=48, enable_prefix_caching=True),
    "block-size-1": dict(block_size=1, num_gpu_blocks=300, num_cpu_blocks=0, max_num_seqs=8,
                         max_num_batched_tokens=40, enable_prefix_caching=True),
}
ABORT_AFTER = {"r4": 8, "r9": 1, "r13": 12}  # the client hangs up once it has this many tokens


def serve(config: SchedulerConfig, ahead: bool, num_requests: int = 24):
    """Runs the workload, arrivals spread over turns; returns streams, finishes and facts."""
    sched = Scheduler(config)
    driver = StepDriver(sched, SimWorker(config, hashed_tokens(eos_per_mille=40)), ahead)
    streams: dict[tuple[str, int], list[int]] = {}
    finishes: dict[tuple[str, int], str] = {}
    aborted_with_step_out = 0
    turn = 0
    while turn < 5000:
        for i in range(num_requests):
            if i // 3 == turn:
                assert sched.add_request(workload(i)) == []
        aborts = [r for r, k in ABORT_AFTER.items()
                  if r in sched.requests and len(streams.get((r, 0), [])) >= k]
        if aborts:
            aborted_with_step_out += bool(driver.pending)
            for delta in sched.abort_requests(aborts):
                assert delta.new_token_ids == []
                finishes[(delta.request_id, delta.index)] = delta.finish_reason
        if not driver.busy() and turn > num_requests // 3:
            break
        if driver.busy():
            for delta in driver.step()[2]:
                key = (delta.request_id, delta.index)
                assert key not in finishes, f"{key} streamed {delta} after it finished"
                streams.setdefault(key, []).extend(delta.new_token_ids)
                if delta.finish_reason is not None:
                    finishes[key] = delta.finish_reason
        turn += 1
    assert not sched.requests, "workload did not finish"
    assert_all_blocks_free(sched)
    generated = sum(len(tokens) for tokens in streams.values())
    assert sched.counters.generation_tokens == generated
    return streams, finishes, driver.steps_ahead, aborted_with_step_out, sched.stats()


@pytest.mark.parametrize("name", CONFIGS)
def test_scheduling_one_step_ahead_streams_exactly_what_waiting_for_each_result_streams(name):
    config = SchedulerConfig(**CONFIGS[name], max_model_len=96, debug_invariants=True)
    sync = serve(config, ahead=False)
    ahead = serve(config, ahead=True)
    assert ahead[0] == sync[0]
    assert ahead[1] == sync[1]
    assert sync[2] == 0 and ahead[2] > 0  # it did schedule ahead
    if name.startswith("tight"):
        stats = ahead[4]
        assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0


def test_nothing_past_a_stop_max_tokens_or_an_abort_is_streamed_when_scheduling_ahead():
    config = SchedulerConfig(**CONFIGS["roomy"], max_model_len=96, debug_invariants=True)
    streams, finishes, steps_ahead, _, _ = serve(config, ahead=True)
    assert steps_ahead > 0
    reasons = set()
    for i in range(24):
        msg = workload(i)
        stops = set(msg.sampling.stop_token_ids) | (set() if msg.sampling.ignore_eos else {EOS})
        for index in range(msg.sampling.n):
            key = (msg.request_id, index)
            tokens, finish = streams.get(key, []), finishes[key]
            reasons.add(finish)
            assert len(tokens) <= msg.sampling.max_tokens
            assert not stops & set(tokens[:-1]), f"{key} went on past a stop token: {tokens}"
            if finish == "stop":
                assert tokens[-1] in stops
            elif finish == "length":
                assert len(tokens) == msg.sampling.max_tokens and not stops & set(tokens)
            elif finish == "abort":
                assert len(tokens) == ABORT_AFTER[msg.request_id]  # not one token more
    assert reasons == {"stop", "length", "abort"}


def test_a_sequence_that_stops_is_finished_one_step_late_and_its_extra_token_is_dropped():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                             debug_invariants=True)
    sched = Scheduler(config)
    worker = SimWorker(config, lambda req_id, tokens: EOS if len(tokens) == 8 else 500 + len(tokens))
    sched.add_request(request("a", [3, 4, 5], max_tokens=20))
    sched.add_request(request("b", [3, 4, 5, 6, 7, 8], max_tokens=3))
    driver = StepDriver(sched, worker, ahead=True)
    deltas = []
    while driver.busy():
        out, result, step_deltas = driver.step()
        deltas.extend(step_deltas)
    streams = {}
    for delta in deltas:
        streams.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert streams == {"a": [503, 504, 505, 506, 507, EOS], "b": [506, 507, EOS]}
    assert driver.steps_ahead > 0
    # the workers computed (and sampled) past each end: those samples went nowhere
    assert sched.counters.generation_tokens == 9
    assert_all_blocks_free(sched)


def test_a_step_cannot_be_scheduled_ahead_of_one_whose_samplers_are_not_plain_decodes():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
    sched = Scheduler(config)
    sched.add_request(request("a", [3, 4, 5], max_tokens=20))
    sched.schedule()  # the prefill samples outside the decode lane
    assert not sched.can_schedule_ahead()
    with pytest.raises(SchedulerStateError, match="cannot be scheduled ahead"):
        sched.schedule()


def test_an_abort_while_two_steps_are_out_streams_and_counts_nothing_more():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                             debug_invariants=True)
    sched = Scheduler(config)
    worker = SimWorker(config, lambda req_id, tokens: 500 + len(tokens))
    for name in "ab":
        sched.add_request(request(name, [3, 4, 5], max_tokens=30))
    driver = StepDriver(sched, worker, ahead=True)
    streams: dict[str, list[int]] = {"a": [], "b": []}
    aborted = False
    while driver.busy():
        if not aborted and len(streams["a"]) == 5:
            assert driver.pending, "a step was scheduled ahead and is out"
            assert [d.finish_reason for d in sched.abort_requests(["a"])] == ["abort"]
            aborted = True
        for delta in driver.step()[2]:
            assert not (aborted and delta.request_id == "a"), f"streamed {delta} after the abort"
            streams[delta.request_id] += delta.new_token_ids
    assert streams == {"a": [503 + k for k in range(5)], "b": [503 + k for k in range(30)]}
    assert sched.counters.generation_tokens == 35
    assert_all_blocks_free(sched)


def _one_request_in_the_lane() -> tuple[Scheduler, StepDriver]:
    """"a" (30 tokens) decoding in the lane, overlapped: a step ahead is out."""
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                             debug_invariants=True)
    sched = Scheduler(config)
    sched.add_request(request("a", [3, 4, 5], max_tokens=30))
    return sched, StepDriver(sched, SimWorker(config, lambda req_id, tokens: 500 + len(tokens)), ahead=True)


def test_a_new_prompt_joins_the_decode_lane_while_the_step_ahead_is_out():
    sched, driver = _one_request_in_the_lane()
    waited = []  # per step scheduled: whether nothing was out (the workers wait for it)
    driver.on_schedule = lambda out: waited.append(not driver.pending)
    streams: dict[str, list[int]] = {"a": [], "b": []}

    def run(turns: int) -> None:
        for _ in range(turns):
            for delta in driver.step()[2]:
                streams[delta.request_id] += delta.new_token_ids

    run(5)
    assert [out.decodes.req_ids for out in driver.pending] == [["a"]]  # a decodes in the lane, a step ahead out
    before = len(waited)
    assert sched.add_request(request("b", [6, 7], max_tokens=10)) == []
    run(6)
    b = sched.requests["b"].sequences[0]
    assert "b" in driver.pending[-1].decodes.req_ids and len(streams["b"]) >= 3  # in the lane, decoding
    assert not any(waited[before:]), "a step waited for b's first token"
    run(40)
    assert streams == {"a": [503 + k for k in range(30)], "b": [502 + k for k in range(10)]}
    assert sched.counters.generation_tokens == 40
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("extra", [{"logprobs": True}, {"n": 2}], ids=["logprobs", "n=2"])
def test_a_new_prompt_that_will_not_join_the_lane_is_waited_for_instead(extra):
    sched, driver = _one_request_in_the_lane()
    for _ in range(5):
        driver.step()
    assert [out.decodes.req_ids for out in driver.pending] == [["a"]]
    assert sched.add_request(request("b", [6, 7, 8, 9, 10], max_tokens=10, **extra)) == []
    ahead_after_b = []  # for each step in which b samples: may the next one go out before its result?
    ahead_of_b = []  # for each step scheduled while another was out: did b sample in the one out?

    def on_schedule(out) -> None:
        if len(sched.in_flight) == 2:
            ahead_of_b.append(any(seq.request_id == "b" for seq in sched.in_flight[0][1]))
        _, sampling, _ = sched.in_flight[-1]
        if any(seq.request_id == "b" for seq in sampling):
            ahead_after_b.append(sched.can_schedule_ahead())

    driver.on_schedule = on_schedule
    while driver.busy():
        driver.step()
    # b samples outside the lane and stays there (its logprobs, or a fork to come): each next
    # step needs its token, so none is scheduled ahead of it
    assert ahead_after_b and not any(ahead_after_b)
    if "logprobs" in extra:  # never in the lane, so no step goes out while one it samples in is out
        assert not any(ahead_of_b)  # (b's samples join the lane with their first token and sit the step ahead out)


def test_a_lane_sequence_that_ends_while_the_step_ahead_is_out_holds_no_step_back():
    # Four requests decode in the lane; b (max_tokens), c (a stop token) and d (an abort) end
    # while the step scheduled ahead holds them, each moving a later position into its gap.
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                             debug_invariants=True)
    sched = Scheduler(config)
    base = {"a": 1000, "b": 2000, "c": 3000, "d": 4000}  # each request's own tokens: a misrouted one shows
    sched.add_request(request("a", [3, 4, 5], max_tokens=20, ignore_eos=True))
    sched.add_request(request("b", [3, 4, 5], max_tokens=6, ignore_eos=True))
    sched.add_request(request("c", [3, 4, 5], max_tokens=20, stop_token_ids=[3009]))
    sched.add_request(request("d", [3, 4, 5], max_tokens=20, ignore_eos=True))
    driver = StepDriver(sched, SimWorker(config, lambda req_id, tokens: base[req_id] + len(tokens)), ahead=True)
    waited = []
    driver.on_schedule = lambda out: waited.append(not driver.pending)
    streams: dict[str, list[int]] = {name: [] for name in base}
    while driver.busy():
        if len(streams["d"]) == 4 and "d" in sched.requests:
            assert driver.pending, "a step was scheduled ahead and is out"
            sched.abort_requests(["d"])
        for delta in driver.step()[2]:
            streams[delta.request_id] += delta.new_token_ids
    assert streams == {"a": [1003 + k for k in range(20)], "b": [2003 + k for k in range(6)],
                       "c": [3003 + k for k in range(7)], "d": [4003 + k for k in range(4)]}
    # the prefill's step and the first decode (after the prefill's result) went out with nothing
    # out; every later step went out while the one before it ran
    assert waited[:2] == [True, True] and not any(waited[2:]), f"waits: {waited}"
    assert sched.counters.generation_tokens == 37
    assert_all_blocks_free(sched)
