"""prompt_logprobs: every prompt position's logprobs equal log_softmax of transformers' logits on
the same weights, across chunked prefill, with the prefix cache on, offline; the scheduler's
joining of chunks sends each position once."""

from __future__ import annotations

import pytest
import torch

from pagedserve.protocol.messages import AddRequest, PromptLogprobs, SamplingParams
from pagedserve.protocol.step_state import HeldRequest
from pagedserve.scheduler_proc import prompt_logprobs as prompt_lp
from pagedserve.scheduler_proc.request import Request, Sequence, token_array
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.worker_proc import prompt_logprobs as worker_prompt_lp

from support.scheduler_sim import SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done


def _request(prompt_len: int, k: int = 1) -> Sequence:
    msg = AddRequest("r", list(range(3, 3 + prompt_len)), SamplingParams(prompt_logprobs=k))
    request = Request(msg, 0, 7, 1000)
    return Sequence("r", request, 0, token_array(msg.prompt_token_ids), request.sampling, False)


def _chunk(start: int, count: int, base: float = 0.0) -> PromptLogprobs:
    return PromptLogprobs(start, [base - i for i in range(count)], [1] * count, [[(0, -0.1)]] * count)


def test_chunks_join_in_order_and_a_recomputed_chunk_is_not_sent_again():
    seq = _request(8)
    prompt_lp.merge(1, {"r": _chunk(1, 3)}, {"r": seq})
    prompt_lp.merge(2, {"r": _chunk(4, 2, base=-3.0)}, {"r": seq})
    # recompute-preemption: the workers compute the prompt from position 0 again
    prompt_lp.merge(3, {"r": _chunk(1, 7, base=-99.0)}, {"r": seq})
    held = prompt_lp.complete(seq.request)
    assert (held.start, held.end) == (1, 8)
    assert held.logprobs[:5] == [0.0, -1.0, -2.0, -3.0, -4.0]  # the first-received values kept
    assert held.logprobs[5:] == [-99.0 - 5, -99.0 - 6]  # only new positions taken from the recompute
    # once complete, a recomputed sequence is sent to the workers without prompt_logprobs
    assert prompt_lp.sampling_to_send(seq.request, seq.sampling).prompt_logprobs is None


def test_a_gap_an_overrun_or_an_unasked_request_is_a_mismatch():
    seq = _request(8)
    with pytest.raises(prompt_lp.PromptLogprobsMismatch, match="missing"):
        prompt_lp.merge(1, {"r": _chunk(2, 2)}, {"r": seq})
    with pytest.raises(prompt_lp.PromptLogprobsMismatch, match="8-token prompt"):
        prompt_lp.merge(1, {"r": _chunk(1, 8)}, {"r": seq})
    with pytest.raises(prompt_lp.PromptLogprobsMismatch, match="did not ask"):
        prompt_lp.merge(1, {"other": _chunk(1, 2)}, {"r": seq})
    prompt_lp.merge(1, {"r": _chunk(1, 3)}, {"r": seq})
    with pytest.raises(prompt_lp.PromptLogprobsMismatch, match=r"tokens \[1, 4\)"):
        prompt_lp.complete(seq.request)  # sampling before the whole prompt was scored
    assert prompt_lp.sampling_to_send(seq.request, seq.sampling).prompt_logprobs == 1


def test_the_worker_scores_only_the_asking_requests_prompt_rows_of_this_chunk(monkeypatch):
    monkeypatch.setattr(worker_prompt_lp, "ROWS_PER_SLICE", 2)  # several slices per chunk
    vocab, width = 11, 5
    prompt = [1, 4, 9, 2, 7, 3, 8, 6]
    plain = HeldRequest("plain", [5, 6, 7], 3, [0], 0, 3, SamplingParams())
    # computes positions 4..8 (the last one samples): tokens 5, 6, 7 are scored from positions 4, 5, 6
    asking = HeldRequest("asking", prompt, 8, [1], 4, 4, SamplingParams(prompt_logprobs=2))
    first_chunk = HeldRequest("first", prompt, 8, [2], 0, 2, SamplingParams(prompt_logprobs=0))
    rows = 3 + 4 + 2
    hidden = torch.randn(rows, width, generator=torch.Generator().manual_seed(1))
    head = torch.randn(vocab, width, generator=torch.Generator().manual_seed(2))
    calls = []

    def compute_logits(h):
        calls.append(h.shape[0])
        return h @ head.T

    scored = worker_prompt_lp.compute_prompt_logprobs(hidden, [plain, asking, first_chunk], compute_logits)
    assert set(scored) == {"asking", "first"} and sum(calls) == 3 + 2  # no row of "plain", nor the sampling one
    expected = torch.log_softmax(hidden @ head.T, -1)
    got = scored["asking"]
    assert (got.start, got.end) == (5, 8)
    for i, position in enumerate(range(4, 7)):
        row = expected[3 + i]
        target = prompt[position + 1]
        assert got.logprobs[i] == pytest.approx(float(row[target]), abs=1e-6)
        assert got.ranks[i] == int((row > row[target]).sum()) + 1
        assert [t for t, _ in got.top_logprobs[i]] == row.topk(2).indices.tolist()
    first = scored["first"]
    assert (first.start, first.end, first.top_logprobs) == (1, 3, [[], []])
    assert first.logprobs == pytest.approx([float(expected[7][prompt[1]]), float(expected[8][prompt[2]])], abs=1e-6)


def _score(index: int, token: int) -> float:
    return -(index * 1000.0 + token)  # what the simulated worker reports for prompt token ``index``


class ScoringWorker(SimWorker):
    """The simulated worker, also scoring the prompt positions each prefill chunk computes
    (with the real worker's choice of positions); counts how often each is sent."""

    def step(self, out):
        result = super().step(out)
        prefills = [self.held[r.req_id] for r in (*out.new_requests, *out.cached_requests)]
        chunks = {}
        for held, _, start, count in worker_prompt_lp.prompt_positions(prefills):
            tokens = range(start + 1, start + 1 + count)
            for i in tokens:
                self.sent[(held.req_id, i)] = self.sent.get((held.req_id, i), 0) + 1
            chunks[held.req_id] = PromptLogprobs(start + 1, [_score(i, held.token_ids[i]) for i in tokens],
                                                 [1] * count, [[] for _ in tokens])
        result.prompt_logprobs = chunks or None
        return result


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_each_prompt_position_reaches_each_sample_once_through_chunks_preemption_and_the_prefix_cache(
        preemption_mode):
    config = SchedulerConfig(block_size=4, num_gpu_blocks=7, num_cpu_blocks=16, max_num_seqs=4,
                             max_num_batched_tokens=8, preemption_mode=preemption_mode,
                             enable_prefix_caching=True, debug_invariants=True)
    sched = Scheduler(config)
    worker = ScoringWorker(config, counting_tokens())
    worker.sent = {}
    prompts = {"a": list(range(20, 30)), "b": list(range(20, 39)), "c": list(range(20, 33))}
    sched.add_request(request("warm", list(range(20, 39)), max_tokens=2))  # fills the prefix cache
    run_until_done(sched, worker)
    for rid, prompt in prompts.items():
        sched.add_request(request(rid, prompt, max_tokens=8, ignore_eos=True, prompt_logprobs=0,
                                  n=2 if rid == "b" else 1))
    deltas = run_until_done(sched, worker)
    stats = sched.stats()
    assert stats[f"num_preemptions_{preemption_mode}"] >= 1
    with_prompt = [d for d in deltas if d.prompt_logprobs is not None]
    assert sorted((d.request_id, d.index) for d in with_prompt) == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    for delta in with_prompt:
        prompt = prompts[delta.request_id]
        scored = delta.prompt_logprobs
        assert (scored.start, scored.end) == (1, len(prompt))
        assert scored.logprobs == [_score(i, prompt[i]) for i in range(1, len(prompt))]
    resent = sum(count - 1 for count in worker.sent.values())
    # recomputed mid-prefill, the workers score positions again; the frontend still gets each once.
    # Swapped out and back in, nothing is computed twice.
    assert resent > 0 if preemption_mode == "recompute" else resent == 0
    assert_all_blocks_free(sched)


