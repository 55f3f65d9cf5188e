"""What a ModelRunner reports about itself and how it refuses what it cannot run."""

from __future__ import annotations

import json

import pytest

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.protocol.messages import (
    CachedRequestData, DecodeBatch, NewRequestData, SamplingParams, SchedulerOutput, WorkerInit,
)
from pagedserve.worker_proc.input_batch import BatchError
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler, random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m"), "qwen2", num_layers=2, num_kv_heads=2, hidden_size=64)


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        ModelRunner(str(tmp_path), model_impl="native")
    message = str(refused.value)
    assert "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


def test_the_model_id_names_the_architecture_and_the_config_but_not_the_transformers_that_wrote_it(
        model_dir, tmp_path):
    from pagedserve.worker_proc.model_config import load_model_spec

    model_id = ModelRunner(str(model_dir)).model_id
    assert model_id.startswith("Qwen2ForCausalLM:")
    config = json.loads((model_dir / "config.json").read_text())
    for name, change in (("rewritten", {"transformers_version": "4.0.0"}), ("other", {"rms_norm_eps": 1e-3})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}, indent=4))
    assert load_model_spec(tmp_path / "rewritten").model_id == model_id
    assert load_model_spec(tmp_path / "other").model_id != model_id


def test_block_bytes_and_the_cpu_block_budget(model_dir):
    runner = ModelRunner(str(model_dir))
    # 2 layers * K,V * 16 slots * 2 kv heads * head_dim 16 * 4 bytes
    assert runner.num_layers == 2
    assert runner.block_bytes(16) == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.max_gpu_blocks(16, memory_bytes=10 * runner.block_bytes(16) + 1) == 10
    assert runner.max_gpu_blocks(16) == (1 << 30) // runner.block_bytes(16)


def test_init_cache_allocates_the_documented_layout(model_dir):
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(block_size=8, num_gpu_blocks=5, num_cpu_blocks=3,
                                 max_model_len=64, seed=0))
    assert tuple(runner.kv_cache.shape) == (2, 2, 5, 8, 2, 16)
    assert tuple(runner.host_cache.shape) == (2, 2, 3, 8, 2, 16)


def test_a_step_before_init_cache_is_an_error_that_says_so(model_dir):
    with pytest.raises(RuntimeError, match="init_cache"):
        ModelRunner(str(model_dir)).poison_cache()


def test_a_diff_for_a_request_the_worker_never_saw_is_refused(model_dir):
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(block_size=8, num_gpu_blocks=4, num_cpu_blocks=0,
                                 max_model_len=32, seed=0))
    step = SchedulerOutput(
        step=0, new_requests=[], cached_requests=[CachedRequestData("ghost", [5], [], 3, 1, True)],
        decodes=DecodeBatch([], [], [], []), finished_req_ids=[], blocks_to_swap_out=[], blocks_to_swap_in=[],
        blocks_to_copy=[], new_block_ids_to_zero=[], total_num_scheduled_tokens=1,
    )
    with pytest.raises(BatchError, match="'ghost' is unknown"):
        runner.execute(step)


def test_a_request_scheduled_past_its_block_table_is_refused(model_dir):
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0,
                                 max_model_len=32, seed=0))
    request = NewRequestData("a", list(range(3, 12)), 9, [0, 1], 0, 9, SamplingParams(temperature=0.0), True)
    step = SchedulerOutput(
        step=0, new_requests=[request], cached_requests=[], decodes=DecodeBatch([], [], [], []),
        finished_req_ids=[], blocks_to_swap_out=[],
        blocks_to_swap_in=[], blocks_to_copy=[], new_block_ids_to_zero=[], total_num_scheduled_tokens=9,
    )
    with pytest.raises(BatchError, match="need 3 blocks"):
        runner.execute(step)


GREEDY_LOGPROBS = SamplingParams(temperature=0.0, logprobs=True)


def small_runner(model_dir) -> ModelRunner:
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(block_size=4, num_gpu_blocks=12, num_cpu_blocks=0,
                                 max_model_len=48, seed=0))
    return runner


def step(number: int, new=(), cached=(), decodes=None, total: int = 0) -> SchedulerOutput:
    return SchedulerOutput(step=number, new_requests=list(new), cached_requests=list(cached),
                           decodes=decodes or DecodeBatch([], [], [], []), finished_req_ids=[], blocks_to_swap_out=[],
                           blocks_to_swap_in=[], blocks_to_copy=[], new_block_ids_to_zero=[],
                           total_num_scheduled_tokens=total)


def prefilled_runner(model_dir):
    """A runner holding "a" (5 prompt tokens) and "b" (8: its next token needs a new block),
    both prefilled; returns it with the token each sampled."""
    runner = small_runner(model_dir)
    result = runner.execute(step(0, new=[
        NewRequestData("a", list(range(3, 8)), 5, [0, 1], 0, 5, GREEDY_LOGPROBS, True),
        NewRequestData("b", list(range(20, 28)), 8, [2, 3], 0, 8, GREEDY_LOGPROBS, True),
    ], total=13))
    assert result.req_ids == ["a", "b"]
    return runner, dict(zip(result.req_ids, result.sampled_token_ids))


def test_decodes_in_a_decode_batch_run_exactly_as_the_same_decodes_sent_as_cached_diffs(model_dir):
    """A new request and two decodes share a step (one decode gets a fresh block through
    new_blocks), then both decode once more: tokens and logprobs match the diff encoding."""
    results = {}
    for encoding in ("decodes", "cached"):
        runner, sampled = prefilled_runner(model_dir)
        new = NewRequestData("c", list(range(40, 46)), 6, [5, 6], 0, 6, GREEDY_LOGPROBS, True)
        if encoding == "decodes":
            first = step(1, new=[new], decodes=DecodeBatch(["a", "b"], [5, 8], [sampled["a"], sampled["b"]],
                                                           [(1, 4)]), total=8)
        else:
            first = step(1, new=[new], cached=[CachedRequestData("a", [sampled["a"]], [], 5, 1, True),
                                               CachedRequestData("b", [sampled["b"]], [4], 8, 1, True)], total=8)
        one = runner.execute(first)
        assert one.req_ids == ["c", "a", "b"] and one.error is None
        sampled.update(zip(one.req_ids, one.sampled_token_ids))
        ids = ["a", "b", "c"]  # the second decode of "b" reads the KV written into block 4
        if encoding == "decodes":
            second = step(2, decodes=DecodeBatch(ids, [6, 9, 6], [sampled[r] for r in ids], []), total=3)
        else:
            second = step(2, cached=[CachedRequestData(r, [sampled[r]], [], n, 1, True) for r, n in zip(ids, [6, 9, 6])],
                          total=3)
        two = runner.execute(second)
        results[encoding] = [(r.req_ids, r.sampled_token_ids, r.logprobs) for r in (one, two)]
    assert results["decodes"] == results["cached"]


def test_the_harness_gives_the_same_tokens_with_and_without_decode_batches(model_dir):
    outputs = []
    for decode_batch in (True, False):
        scheduler = TrivialScheduler(ModelRunner(str(model_dir)), decode_batch=decode_batch)
        for i, prompt in enumerate(random_prompts([5, 13, 9], vocab_size=512, seed=1)):
            scheduler.add(f"r{i}", prompt, 10, prefill_chunks=[4] if i == 1 else None, arrival_step=i)
        outputs.append(scheduler.run())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("decodes, refusal", [
    (DecodeBatch(["a", "ghost"], [5, 3], [1, 1], []), "decode request 'ghost' is unknown"),
    (DecodeBatch(["a"], [5], [1], [(1, 4)]), "names decode 1, but the step has 1 decodes"),
    (DecodeBatch(["a"], [5], [1], [(-1, 4)]), "names decode -1"),
    (DecodeBatch(["a"], [4], [1], []), "position 4 but 5 tokens are held here"),
    (DecodeBatch(["a", "b"], [5], [1, 1], []), "2 req_ids but 1 num_computed_tokens"),
])
def test_a_decode_batch_the_worker_cannot_apply_is_refused(model_dir, decodes, refusal):
    runner, _ = prefilled_runner(model_dir)
    with pytest.raises(BatchError, match=refusal):
        runner.execute(step(1, decodes=decodes, total=len(decodes.req_ids)))
