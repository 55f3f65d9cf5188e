"""The scheduler's side of embedding requests: each prompt position reaches the pooled sum once,
whatever happens to the request on the way (chunks, swap, recompute, steps scheduled ahead, a
generation request beside it), and a result that does not fit what the step computed is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.protocol.messages import AddRequest, PooledChunk, SamplingParams, StepResult
from pagedserve.scheduler_proc import pooling
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.output_processor import StepResultMismatch
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.worker_proc.pooling import pool_chunks

from support.scheduler_sim import SimWorker, assert_all_blocks_free, counting_tokens, request, run_until_done


def _state(position: int, token: int) -> list[float]:
    """The simulated hidden state of ``token`` at ``position``: known, and different everywhere."""
    return [float(position), float(token), 1.0]


class PoolingWorker(SimWorker):
    """The simulated worker, also pooling with the real worker's choice of rows (pool_chunks)."""

    def step(self, out):
        result = super().step(out)
        entries = [self.held[r.req_id] for r in (*out.new_requests, *out.cached_requests)]
        rows = [_state(p, held.token_ids[p]) for held in entries
                for p in range(held.num_computed_tokens, held.num_computed_tokens + held.num_scheduled_tokens)]
        hidden = torch.tensor(rows or [[0.0] * 3], dtype=torch.float32)
        result.pooled = pool_chunks(hidden, entries, lambda h: h) or None
        return result


def _expected(prompt: list[int], kind: str) -> np.ndarray:
    states = np.array([_state(p, t) for p, t in enumerate(prompt)])
    return states[-1] if kind == "last" else states.mean(0)


def _embedding(delta) -> np.ndarray:
    return np.frombuffer(delta.embedding, "<f4")


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("ahead", [False, True])
def test_every_position_is_pooled_once_through_chunks_preemption_and_steps_ahead(preemption_mode, ahead):
    config = SchedulerConfig(block_size=4, num_gpu_blocks=7, num_cpu_blocks=16, max_num_seqs=4,
                             max_num_batched_tokens=8, preemption_mode=preemption_mode, debug_invariants=True)
    sched = Scheduler(config)
    worker = PoolingWorker(config, counting_tokens())
    prompts = {"a": list(range(20, 39)), "b": list(range(40, 53)), "c": list(range(60, 71))}
    sched.add_request(request("gen", list(range(5, 12)), max_tokens=20, ignore_eos=True))  # grows: preempts
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=1), pooling=("mean", "last")[i % 2]))
    deltas = run_until_done(sched, worker, ahead=ahead)
    assert sched.stats()[f"num_preemptions_{preemption_mode}"] >= 1
    pooled = {d.request_id: d for d in deltas if d.embedding is not None}
    assert set(pooled) == set(prompts)
    for i, (rid, prompt) in enumerate(prompts.items()):
        np.testing.assert_allclose(_embedding(pooled[rid]), _expected(prompt, ("mean", "last")[i % 2]), rtol=1e-6)
        assert (pooled[rid].finish_reason, pooled[rid].new_token_ids) == ("stop", [])
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "gen") == 20
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("first", ["mean", "last"])
def test_an_embedding_requests_blocks_outlive_it_and_the_same_prompt_embedded_again_hits_them(first):
    config = SchedulerConfig(block_size=4, num_gpu_blocks=16, enable_prefix_caching=True, debug_invariants=True)
    sched, worker = Scheduler(config), PoolingWorker(config, counting_tokens())
    prompt = list(range(20, 29))  # two full blocks and one token
    sched.add_request(AddRequest("one", prompt, SamplingParams(max_tokens=1), pooling=first))
    run_until_done(sched, worker)
    sched.add_request(AddRequest("two", prompt, SamplingParams(max_tokens=1), pooling="last"))
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_requests] == [("two", 8)]
    deltas = list(sched.update_from_output(out, worker.step(out))) + run_until_done(sched, worker)
    [pooled] = [d for d in deltas if d.embedding is not None]
    np.testing.assert_allclose(_embedding(pooled), _expected(prompt, "last"), rtol=1e-6)
    assert_all_blocks_free(sched)


def test_an_embedding_request_may_fill_the_context_a_generation_request_may_not():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=8, max_num_seqs=2, max_num_batched_tokens=16,
                             max_model_len=12)
    sched = Scheduler(config)
    assert sched.add_request(AddRequest("e", list(range(3, 15)), SamplingParams(max_tokens=1), pooling="last")) == []
    refused = sched.add_request(AddRequest("e2", list(range(3, 16)), SamplingParams(max_tokens=1), pooling="last"))
    assert "13 tokens, more than max_model_len=12" in refused[0].error
    refused = sched.add_request(request("g", list(range(3, 15)), max_tokens=1))
    assert "with at least one generated token" in refused[0].error


def _one_step(prompt_len=10, kind="mean"):
    config = SchedulerConfig(block_size=4, num_gpu_blocks=8, max_num_seqs=2, max_num_batched_tokens=16)
    sched = Scheduler(config)
    sched.add_request(AddRequest("e", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=1), pooling=kind))
    return sched, sched.schedule()


def _vector(*values):
    return np.array(values, "<f4").tobytes()


@pytest.mark.parametrize("chunks, match", [
    (None, "pooled positions end at 0"),  # the last chunk computed, nothing pooled
    ({"e": PooledChunk(0, 9, _vector(1, 2))}, r"positions \[0, 9\) in a step that computed up to 10"),
    ({"x": PooledChunk(0, 10, _vector(1, 2))}, "pools nothing this step"),
])
def test_a_result_whose_pooled_chunks_do_not_fit_the_step_is_refused(chunks, match):
    sched, out = _one_step()
    with pytest.raises(StepResultMismatch, match=match):
        sched.update_from_output(out, StepResult(out.step, 0, [], [], pooled=chunks))


def test_last_token_pooling_takes_exactly_the_last_position():
    sched, out = _one_step(kind="last")
    with pytest.raises(StepResultMismatch, match="pools its last token"):
        sched.update_from_output(out, StepResult(out.step, 0, [], [], pooled={"e": PooledChunk(0, 10, _vector(1))}))


def test_a_gap_between_chunks_is_refused():
    sched, out = _one_step()
    request = sched.requests["e"]
    request.pooled = pooling.PooledSum(PooledChunk(0, 3, _vector(1, 1)))
    with pytest.raises(pooling.PooledMismatch, match="from 5, but those before it end at 3"):
        pooling._add(1, request, PooledChunk(5, 5, _vector(1, 1)), 10)


def test_an_embedding_request_asks_for_nothing_to_sample():
    from pagedserve.protocol.validate import InvalidField, check_request

    with pytest.raises(InvalidField, match="samples nothing"):
        check_request(AddRequest("e", [3, 4], SamplingParams(n=2), pooling="mean"))


def test_pooling_fields_cross_the_wire_and_a_malformed_chunk_is_a_protocol_error():
    from pagedserve.protocol import messages as m
    from pagedserve.protocol.codec import Decoder, ProtocolError, encode

    add = AddRequest("e", [3, 4], SamplingParams(max_tokens=1), pooling="mean")
    assert Decoder(m.FrontendToScheduler).decode(encode(add)) == add
    result = StepResult(3, 0, [], [], pooled={"e": PooledChunk(0, 2, _vector(0.5, -1.5))})
    assert Decoder(m.WorkerToScheduler).decode(encode(result)) == result
    import msgspec

    from pagedserve.protocol.codec import PROTOCOL_VERSION

    bad = msgspec.to_builtins(result, builtin_types=(bytes,))
    bad["pooled"]["e"]["values"] = b"abc"
    with pytest.raises(ProtocolError, match="not a float32 vector"):
        Decoder(m.WorkerToScheduler).decode(msgspec.msgpack.encode((PROTOCOL_VERSION, bad)))
    with pytest.raises(ProtocolError):
        Decoder(m.FrontendToScheduler).decode(encode(AddRequest("e", [3], SamplingParams(), pooling="cls")))
