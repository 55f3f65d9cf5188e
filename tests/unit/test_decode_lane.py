"""The decode lane (steady decodes as numpy columns): what leaves it must be exactly what a
per-object scheduler would have produced — every token in order, every block accounted for."""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.decode_lane import RING
from pagedserve.scheduler_proc.scheduler import Scheduler

from support.scheduler_sim import (
    EOS, SimWorker, StepDriver, assert_all_blocks_free, counting_tokens, request, run_until_done,
)


def make(**overrides) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(**{"debug_invariants": True, **overrides})
    return Scheduler(config), SimWorker(config, counting_tokens())


def outputs_by_sample(deltas) -> dict:
    samples: dict = {}
    for delta in deltas:
        samples.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
    return samples


def test_steady_decodes_travel_as_one_decode_batch_and_their_tokens_as_lists():
    sched, worker = make(block_size=4, num_gpu_blocks=64)
    for i in range(3):
        sched.add_request(request(f"r{i}", list(range(10, 15 + i)), max_tokens=20, ignore_eos=True))
    first = sched.schedule()  # three prefills
    assert len(first.new_requests) == 3 and not first.decodes.req_ids
    sched.update_from_output(first, worker.step(first))
    second = sched.schedule()
    assert not second.new_requests and not second.cached_requests
    assert sorted(second.decodes.req_ids) == ["r0", "r1", "r2"]
    outputs = sched.update_from_output(second, worker.step(second))
    assert not outputs.deltas and sorted(outputs.token_request_ids) == ["r0", "r1", "r2"]


def test_every_token_arrives_once_and_in_order_through_preemption_swap_forks_and_ring_flushes():
    # Counting tokens: output i of a p-token prompt is 1000 + p + i. A token lost or repeated
    # by the lane (a ring flush, a hand-back before preemption, a recompute from lane state) shows.
    sched, worker = make(block_size=4, num_gpu_blocks=60, num_cpu_blocks=12, max_num_seqs=8,
                         max_num_batched_tokens=32)
    rng = random.Random(5)
    prompts = {}
    for i in range(12):
        prompts[f"r{i}"] = [rng.randrange(10, 500) for _ in range(rng.randint(3, 12))]
        sched.add_request(request(f"r{i}", prompts[f"r{i}"], max_tokens=RING + 40, ignore_eos=True,
                                  n=2 if i % 5 == 0 else 1))
    deltas = run_until_done(sched, worker)
    stats = sched.stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0
    samples = outputs_by_sample(deltas)
    assert len(samples) == 12 + 3  # three requests with n=2
    for (request_id, _), tokens in samples.items():
        p = len(prompts[request_id])
        assert tokens == [1000 + p + i for i in range(RING + 40)], request_id
    assert_all_blocks_free(sched)


def test_a_steady_decode_read_between_steps_shows_every_token_and_its_progress_without_a_sync():
    # Its newest tokens sit in the lane's ring, not yet flushed, and its progress in the columns:
    # the Sequence reads through to them, so any reader (stats, policies, tests) sees the truth.
    sched, worker = make(block_size=4, num_gpu_blocks=64)
    sched.add_request(request("r", [7, 8, 9], max_tokens=RING + 8, ignore_eos=True))
    for _ in range(6):
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    [seq] = sched.running_sequences()
    assert list(seq.token_ids) == [7, 8, 9] + [1003 + i for i in range(6)]
    assert seq.num_kv_tokens == len(seq.token_ids) - 1 == seq.num_tokens_sent
    assert seq.num_blocks_sent == len(seq.block_ids)
    out = sched.schedule()
    assert out.decodes.req_ids == ["r"] and out.decodes.num_computed_tokens == [8]


def test_an_abort_while_a_step_is_out_drops_only_that_sequence():
    sched, worker = make(block_size=4, num_gpu_blocks=64)
    for i in range(4):
        sched.add_request(request(f"r{i}", [7, 8, 9], max_tokens=10, ignore_eos=True))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    out = sched.schedule()
    assert len(out.decodes.req_ids) == 4
    [aborted] = sched.abort_requests(["r1"])
    assert aborted.finish_reason == "abort"
    outputs = sched.update_from_output(out, worker.step(out))
    assert sorted(outputs.token_request_ids) == ["r0", "r2", "r3"]
    rest = run_until_done(sched, worker)
    samples = outputs_by_sample([*outputs, *rest])
    assert "r1" not in {request_id for request_id, _ in samples}
    assert all(len(tokens) == 10 - 3 for tokens in samples.values())  # 3 steps came before
    assert_all_blocks_free(sched)


def test_stop_tokens_are_per_request_and_wait_for_min_tokens_in_the_lane():
    sched, worker = make(block_size=4, num_gpu_blocks=64)
    # The counting worker samples 1000 + length: r-stop's prompt of 3 makes its 6th output 1008.
    sched.add_request(request("r-stop", [1, 2, 3], max_tokens=30, stop_token_ids=[1008]))
    sched.add_request(request("r-other", [1, 2, 3], max_tokens=12, ignore_eos=True))  # samples 1008 too
    sched.add_request(request("r-min", [1, 2, 3], max_tokens=30, stop_token_ids=[1004, 1010], min_tokens=4))
    deltas = run_until_done(sched, worker)
    ends = {d.request_id: d for d in deltas if d.finish_reason}
    samples = outputs_by_sample(deltas)
    assert ends["r-stop"].finish_reason == "stop" and samples[("r-stop", 0)][-1] == 1008
    assert ends["r-stop"].stop_token_id == 1008
    assert ends["r-other"].finish_reason == "length" and len(samples[("r-other", 0)]) == 12
    assert ends["r-other"].stop_token_id is None  # a length end: its last token is text the client keeps
    # 1004 is the 2nd output, before min_tokens=4: ignored; 1010 (the 8th) stops it.
    assert ends["r-min"].finish_reason == "stop" and samples[("r-min", 0)][-1] == 1010
    assert EOS not in samples[("r-min", 0)]


def test_a_follow_up_turn_hits_the_blocks_its_first_turn_generated():
    # A chat's next turn repeats the last answer: the blocks the lane filled while decoding it
    # must be named in the prefix cache by exactly their tokens (the simulated worker checks
    # every slot the second request attends over).
    sched, worker = make(block_size=4, num_gpu_blocks=64, enable_prefix_caching=True)
    prompt = [11, 12, 13, 14, 15, 16]
    sched.add_request(request("turn-1", prompt, max_tokens=RING + 10, ignore_eos=True))
    answer = outputs_by_sample(run_until_done(sched, worker))[("turn-1", 0)]
    follow_up = prompt + answer + [21, 22, 23]
    sched.add_request(request("turn-2", follow_up, max_tokens=2, ignore_eos=True))
    deltas = run_until_done(sched, worker)
    cached = next(d.num_cached_tokens for d in deltas if d.request_id == "turn-2")
    # Every full block of prompt + answer except the one holding the answer's last token,
    # which was sampled but never computed.
    assert cached == (len(prompt) + len(answer) - 1) // 4 * 4
    assert outputs_by_sample(deltas)[("turn-2", 0)] == [1000 + len(follow_up), 1001 + len(follow_up)]


def test_a_decode_batch_once_sent_is_never_changed_by_later_steps():
    sched, worker = make(block_size=4, num_gpu_blocks=64, max_num_seqs=8)
    for i in range(6):
        sched.add_request(request(f"r{i}", [5, 6, 7], max_tokens=4 + i, ignore_eos=True))
    sent = []
    while sched.has_unfinished():
        out = sched.schedule()
        outputs = sched.update_from_output(out, worker.step(out))
        sent.append((out.decodes, list(out.decodes.req_ids), outputs, list(outputs.token_request_ids)))
    for decodes, ids, outputs, token_ids in sent:  # lane members finished and left in between
        assert decodes.req_ids == ids and outputs.token_request_ids == token_ids


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "scheduled-ahead"])
def test_blocks_filled_side_by_side_are_each_named_by_their_own_tokens(ahead):
    # Many lane members fill a block in the same step (named together from the ring), some just
    # after entering (named per object in that same step), with and without a step out ahead
    # (the block that filled is then the one before the tail). Each follow-up turn must hit
    # every block its own first turn filled, and the worker checks the KV it attends over.
    sched, worker = make(block_size=4, num_gpu_blocks=1024, max_num_seqs=32, enable_prefix_caching=True)
    prompts = {f"a{i}": [100 + 20 * i + j for j in range(5 + i % 3)] for i in range(10)}
    arrivals = {step: [f"a{i}" for i in range(10) if i % 4 == step] for step in range(4)}
    # Late arrivals as long as the early ones are by then: an entry must not disturb the key
    # chain of the members already there (the same number of blocks named).
    prompts.update({f"b{i}": [900 + 30 * i + j for j in range(14 + i)] for i in range(8)})
    arrivals[12] = [f"b{i}" for i in range(8)]
    answers_len = {rid: RING + 9 + int(rid[1:]) for rid in prompts}

    def arrive(step):
        for rid in arrivals.get(step, []):
            sched.add_request(request(rid, prompts[rid], max_tokens=answers_len[rid], ignore_eos=True))

    arrive(0)
    steps = iter(range(1, 10_000))
    answers = outputs_by_sample(run_until_done(sched, worker, ahead=ahead,
                                               on_step=lambda *_: arrive(next(steps))))
    for rid, prompt in prompts.items():
        assert len(answers[(rid, 0)]) == answers_len[rid]
        follow_up = prompt + answers[(rid, 0)] + [21, 22, 23]
        sched.add_request(request("turn-2-" + rid, follow_up, max_tokens=1, ignore_eos=True))
        cached = next(d.num_cached_tokens for d in run_until_done(sched, worker) if d.request_id == "turn-2-" + rid)
        assert cached == (len(follow_up) - 4) // 4 * 4, rid
    assert_all_blocks_free(sched)


def test_an_abort_while_two_steps_are_out_lands_both_results_on_the_sequences_left():
    # Members that entered while a step was out are in the step ahead only: aborting one of them
    # (not the newest: the newest moves into its place) must redirect the result of the step
    # ahead too, or the moved sequence gets the aborted one's token.
    sched, worker = make(block_size=4, num_gpu_blocks=256, max_num_seqs=16)
    driver = StepDriver(sched, worker, ahead=True)
    prompts = {f"r{i}": list(range(10, 13 + i)) for i in range(3)}
    prompts.update({f"n{i}": list(range(20, 26 + 2 * i)) for i in range(3)})
    aborted = []

    def abort_one_that_only_the_step_ahead_holds(out):
        if aborted or len(driver.pending) != 1:
            return
        held_by_first = len(driver.pending[0].decodes.req_ids)
        if len(out.decodes.req_ids) > held_by_first + 1:
            aborted.append(out.decodes.req_ids[held_by_first])
            sched.abort_requests(aborted)

    driver.on_schedule = abort_one_that_only_the_step_ahead_holds
    for rid in ("r0", "r1", "r2"):
        sched.add_request(request(rid, prompts[rid], max_tokens=12, ignore_eos=True))
    deltas = []
    for step in range(200):
        if step == 3:
            for rid in ("n0", "n1", "n2"):
                sched.add_request(request(rid, prompts[rid], max_tokens=12, ignore_eos=True))
        if not driver.busy():
            break
        deltas.extend(driver.step()[2])
    assert len(aborted) == 1 and aborted[0].startswith("n")
    samples = outputs_by_sample(deltas)
    for rid, prompt in prompts.items():
        if rid not in aborted:
            assert samples[(rid, 0)] == [1000 + len(prompt) + i for i in range(12)], rid
    assert_all_blocks_free(sched)


def test_a_steady_decode_read_after_its_ring_wrapped_twice_shows_every_token():
    # A position is flushed every RING results: from the second time on the ring holds exactly
    # RING unflushed tokens, the whole row wrapped around. (The invariant checks read every
    # sequence's tokens each step, flushing the ring: off here.)
    sched, worker = make(block_size=4, num_gpu_blocks=512, debug_invariants=False)
    for i in range(3):
        sched.add_request(request(f"r{i}", list(range(7, 10 + i)), max_tokens=3 * RING, ignore_eos=True))
    steps = 2 * RING + 5
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    for seq in sched.running_sequences():
        prompt = list(range(7, 10 + int(seq.request_id[1:])))
        assert list(seq.token_ids) == prompt + [1000 + len(prompt) + i for i in range(steps)], seq.request_id
        assert seq.num_kv_tokens == len(seq.token_ids) - 1


def test_a_sequence_cannot_leave_the_lane_while_a_step_out_computes_its_token():
    # Its token would be dropped: the lane refuses loudly, naming it (the scheduler waits instead).
    sched, worker = make(block_size=4, num_gpu_blocks=64)
    sched.add_request(request("r", [7, 8, 9], max_tokens=20, ignore_eos=True))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, worker.step(out))
    [seq] = sched.running_sequences()
    sched.schedule()
    with pytest.raises(RuntimeError, match=f"{seq.seq_id} left the decode lane while a batch out"):
        seq.lane.leave(seq)


def test_a_step_goes_ahead_when_free_blocks_cover_the_steady_decodes_however_many_seats_are_empty():
    # Only the lane's members can ask for a block: its empty seats count for nothing.
    sched, worker = make(block_size=4, num_gpu_blocks=16, max_num_seqs=64)
    for i in range(2):
        sched.add_request(request(f"r{i}", [7, 8, 9], max_tokens=10, ignore_eos=True))
    driver = StepDriver(sched, worker, ahead=True)
    deltas = []
    while driver.busy():
        deltas.extend(driver.step()[2])
    assert driver.steps_ahead >= 5
    assert all(tokens == [1003 + i for i in range(10)] for tokens in outputs_by_sample(deltas).values())
    assert_all_blocks_free(sched)


def test_a_step_goes_ahead_when_the_steady_decodes_next_blocks_take_exactly_the_last_free_ones():
    # 4 blocks: each sequence holds one after its prompt and takes the last two at its fifth position
    sched, worker = make(block_size=4, num_gpu_blocks=4)
    for i in range(2):
        sched.add_request(request(f"r{i}", [7, 8, 9], max_tokens=5, ignore_eos=True))
    driver = StepDriver(sched, worker, ahead=True)
    waited, deltas = [], []
    driver.on_schedule = lambda out: waited.append(not driver.pending)
    while driver.busy():
        deltas.extend(driver.step()[2])
    # the prompts' step and the first decode wait for a result; every later step goes out ahead
    assert waited[:2] == [True, True] and not any(waited[2:]), waited
    assert all(tokens == [1003 + i for i in range(5)] for tokens in outputs_by_sample(deltas).values())
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "scheduled-ahead"])
@pytest.mark.parametrize("seed", range(10))
def test_sequences_moved_by_ends_keep_every_token_through_ring_flushes(ahead, seed):
    # Ends move the newest member into the gap, where the flush schedule is another one's: a
    # moved sequence must still be flushed before the ring wraps onto its oldest token (with a
    # step ahead out too, when the result lands through the rewritten positions). No invariant
    # checks: they read, and so flush, every sequence each step.
    sched, worker = make(block_size=4, num_gpu_blocks=1024, max_num_seqs=32, debug_invariants=False)
    rng = random.Random(seed)
    prompts = {}
    for i in range(24):
        prompts[f"r{i}"] = list(range(5, 8 + rng.randrange(9)))
        lasting = i % 3 == 0
        sched.add_request(request(f"r{i}", prompts[f"r{i}"], ignore_eos=True,
                                  max_tokens=4 * RING if lasting else rng.randrange(RING // 2, 3 * RING)))
    driver = StepDriver(sched, worker, ahead=ahead)
    for _ in range(3 * RING):
        driver.step()
    running = sched.running_sequences()
    assert len(running) >= 8
    for seq in running:
        prompt = prompts[seq.request_id]
        generated = len(seq.token_ids) - len(prompt)
        assert generated > RING
        assert list(seq.token_ids) == prompt + [1000 + len(prompt) + i for i in range(generated)], seq.request_id

# The random-workload property test lives in test_scheduler_workload_properties.py (hypothesis strategies).
