"""What a ModelRunner reports about itself and how it refuses what it cannot run."""

from __future__ import annotations

import hashlib
import json

import pytest

from pagedserve.deploy.demo_model import build_model_dir
from pagedserve.protocol.messages import (
    CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, WorkerInit,
)
from pagedserve.worker_proc.input_batch import BatchError
from pagedserve.worker_proc.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m"), "qwen2", num_layers=2, num_kv_heads=2, hidden_size=64)


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        ModelRunner(str(tmp_path))
    message = str(refused.value)
    assert "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


def test_the_model_id_names_the_architecture_and_hashes_the_config(model_dir):
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    assert ModelRunner(str(model_dir)).model_id == f"Qwen2ForCausalLM:{digest}"


def test_block_bytes_and_the_cpu_block_budget(model_dir):
    runner = ModelRunner(str(model_dir))
    # 2 layers * K,V * 16 slots * 2 kv heads * head_dim 16 * 4 bytes
    assert runner.num_layers == 2
    assert runner.block_bytes(16) == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.max_gpu_blocks(16, memory_bytes=10 * runner.block_bytes(16) + 1) == 10
    assert runner.max_gpu_blocks(16) == (1 << 30) // runner.block_bytes(16)


def test_init_cache_allocates_the_documented_layout(model_dir):
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(replica=0, tp_size=1, block_size=8, num_gpu_blocks=5, num_cpu_blocks=3,
                                 max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2, seed=0))
    assert tuple(runner.kv_cache.shape) == (2, 2, 5, 8, 2, 16)
    assert tuple(runner.host_cache.shape) == (2, 2, 3, 8, 2, 16)


def test_a_step_before_init_cache_is_an_error_that_says_so(model_dir):
    with pytest.raises(RuntimeError, match="init_cache"):
        ModelRunner(str(model_dir)).poison_cache()


def test_a_diff_for_a_request_the_worker_never_saw_is_refused(model_dir):
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(replica=0, tp_size=1, block_size=8, num_gpu_blocks=4, num_cpu_blocks=0,
                                 max_model_len=32, max_num_batched_tokens=32, max_num_seqs=1, seed=0))
    step = SchedulerOutput(
        step=0, new_requests=[], cached_requests=[CachedRequestData("ghost", [5], [], 3, 1)],
        finished_req_ids=[], blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[],
        new_block_ids_to_zero=[], total_num_scheduled_tokens=1,
    )
    with pytest.raises(BatchError, match="'ghost' is unknown"):
        runner.execute(step)


def test_a_request_scheduled_past_its_block_table_is_refused(model_dir):
    runner = ModelRunner(str(model_dir))
    runner.init_cache(WorkerInit(replica=0, tp_size=1, block_size=4, num_gpu_blocks=4, num_cpu_blocks=0,
                                 max_model_len=32, max_num_batched_tokens=32, max_num_seqs=1, seed=0))
    request = NewRequestData("a", list(range(3, 12)), 9, [0, 1], 0, 9, SamplingParams(temperature=0.0))
    step = SchedulerOutput(
        step=0, new_requests=[request], cached_requests=[], finished_req_ids=[], blocks_to_swap_out=[],
        blocks_to_swap_in=[], blocks_to_copy=[], new_block_ids_to_zero=[], total_num_scheduled_tokens=9,
    )
    with pytest.raises(BatchError, match="need 3 blocks"):
        runner.execute(step)
