"""Embeddings through the real scheduler and the real model runner in one process: they equal
transformers' last_hidden_state pooled the same way (last token, mean), within 1e-4 in float32,
for one prompt, a batch, and prompts longer than a step's token budget; the requests never
decode, sample nothing and give their blocks back in the step their prompt ends."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.client.pooling import finish_embedding
from pagedserve.protocol.messages import AddRequest, SamplingParams, WorkerInit
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_runner import ModelRunner

from support.oracle import hf_embedding
from support.scheduler_sim import assert_all_blocks_free

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model_dir(tmp_path_factory.mktemp("embed"), "qwen2", num_layers=2, num_kv_heads=2,
                               hidden_size=64))


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, "cpu", "float32")


def _embed(runner, prompts, pooling, step_tokens=64, prefix_caching=False, warm=()):
    """Every prompt's embedding through Scheduler + ModelRunner; also what the steps looked like."""
    config = SchedulerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=96, max_num_seqs=8,
                             max_num_batched_tokens=step_tokens, max_model_len=MAX_MODEL_LEN,
                             enable_prefix_caching=prefix_caching, debug_invariants=True)
    runner.init_cache(WorkerInit(block_size=BLOCK_SIZE, num_gpu_blocks=96, num_cpu_blocks=0,
                                 max_model_len=MAX_MODEL_LEN, seed=0))
    sched = Scheduler(config)
    steps, deltas = [], []

    def run():
        while sched.has_unfinished():
            out = sched.schedule()
            result = runner.execute(out)
            steps.append((out, result))
            deltas.extend(sched.update_from_output(out, result))

    for i, prompt in enumerate(warm):  # each computed (and cached) before the prompts arrive
        sched.add_request(AddRequest(f"w{i}", prompt, SamplingParams(max_tokens=1), pooling=pooling))
        run()
    steps.clear()
    for i, prompt in enumerate(prompts):
        sched.add_request(AddRequest(f"e{i}", prompt, SamplingParams(max_tokens=1), pooling=pooling))
    run()
    assert_all_blocks_free(sched)
    by_id = {d.request_id: d for d in deltas}
    vectors = [finish_embedding(by_id[f"e{i}"].embedding) for i in range(len(prompts))]
    return vectors, steps, [d for d in deltas if d.request_id.startswith("e")], sched


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_one_prompt_and_a_batch_equal_transformers_pooled_hidden_states(model_dir, runner, pooling):
    prompts = _prompts([9, 1, 17, 30])
    single, _, _, _ = _embed(runner, prompts[:1], pooling)
    batch, steps, deltas, _ = _embed(runner, prompts, pooling)
    assert len(steps) == 1  # the whole batch in one step
    for got, prompt in zip([single[0], *batch], [prompts[0], *prompts]):
        np.testing.assert_allclose(got, hf_embedding(model_dir, prompt, pooling), atol=1e-4)
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
    for delta, prompt in zip(deltas, prompts):
        assert (delta.finish_reason, delta.new_token_ids, delta.num_prompt_tokens) == ("stop", [], len(prompt))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prompts_longer_than_a_step_pool_over_every_chunk(model_dir, runner, pooling):
    prompts = _prompts([50, 23, 37], seed=1)
    vectors, steps, _, _ = _embed(runner, prompts, pooling, step_tokens=16)
    assert len(steps) >= 7  # 110 tokens at most 16 a step
    for got, prompt in zip(vectors, prompts):
        np.testing.assert_allclose(got, hf_embedding(model_dir, prompt, pooling), atol=1e-4)


def test_embedding_requests_never_sample_never_decode_and_free_their_blocks_with_their_last_chunk(runner):
    prompts = _prompts([6, 21], seed=2)
    _, steps, deltas, sched = _embed(runner, prompts, "mean", step_tokens=8)
    assert len(steps) == 4  # 27 prompt tokens, 8 a step: nothing more
    for out, result in steps:
        assert not out.decodes.req_ids and result.req_ids == [] and result.sampled_token_ids == []
        assert not any(r.samples for r in (*out.new_requests, *out.cached_requests))
    assert [d.request_id for d in deltas] == ["e0", "e1"]
    assert sched.stats()["generation_tokens"] == 0
    # the short prompt ended in the first step: its blocks came back there, the long one's stayed
    first_out, first_result = steps[0]
    assert [r.req_id for r in first_out.new_requests] == ["e0", "e1"]
    assert set(first_result.pooled) == {"e0", "e1"}


def test_the_short_request_is_gone_after_its_one_step_while_the_long_one_runs_on(runner):
    config = SchedulerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=8,
                             max_model_len=MAX_MODEL_LEN, debug_invariants=True)
    runner.init_cache(WorkerInit(block_size=BLOCK_SIZE, num_gpu_blocks=32, num_cpu_blocks=0,
                                 max_model_len=MAX_MODEL_LEN, seed=0))
    sched = Scheduler(config)
    for rid, prompt in zip(("short", "long"), _prompts([6, 21], seed=2)):
        sched.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=1), pooling="last"))
    out = sched.schedule()
    ended = list(sched.update_from_output(out, runner.execute(out)))
    assert [(d.request_id, d.finish_reason) for d in ended] == [("short", "stop")]
    assert list(sched.requests) == ["long"]
    assert sched.bm.device.num_free == 32 - 1  # only the long one's first block is held
    out = sched.schedule()
    assert out.finished_req_ids == ["short"] and [r.req_id for r in out.cached_requests] == ["long"]


def test_last_token_pooling_takes_prefix_cache_hits_and_mean_pooling_computes_every_token(model_dir, runner):
    shared = _prompts([24], seed=3)[0]
    prompt = shared + [7, 8, 9]
    for pooling in ("last", "mean"):
        vectors, steps, _, sched = _embed(runner, [prompt], pooling, prefix_caching=True, warm=[shared + [5]])
        np.testing.assert_allclose(vectors[0], hf_embedding(model_dir, prompt, pooling), atol=1e-4)
        computed = steps[-1][0].total_num_scheduled_tokens
        assert computed == (len(prompt) - len(shared) if pooling == "last" else len(prompt))
