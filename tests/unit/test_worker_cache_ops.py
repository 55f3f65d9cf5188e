"""Cache block operations run swap out, swap in, copy, zero, in that order, before the forward."""

from __future__ import annotations

import pytest
import torch

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.protocol.messages import DecodeBatch, SchedulerOutput, WorkerInit
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler, random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model_dir(tmp_path_factory.mktemp("m"), "qwen2"))


def block_step(step: int, **ops) -> SchedulerOutput:
    fields = dict(blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[], new_block_ids_to_zero=[])
    fields.update(ops)
    return SchedulerOutput(step=step, new_requests=[], cached_requests=[], decodes=DecodeBatch([], [], [], []),
                           finished_req_ids=[], total_num_scheduled_tokens=0, **fields)


def block_values(cache: torch.Tensor) -> list[float]:
    """One number per block; every element of a block holds it in these tests."""
    return [float(cache[:, :, b].mean()) for b in range(cache.shape[2])]


def test_swap_out_then_swap_in_then_copy_then_zero(model_dir):
    runner = ModelRunner(model_dir)
    runner.init_cache(WorkerInit(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4,
                                 max_model_len=64, seed=0))
    for b in range(8):
        runner.kv_cache[:, :, b] = b + 1
    for h in range(4):
        runner.host_cache[:, :, h] = 100 + h
    result = runner.execute(block_step(
        0,
        blocks_to_swap_out=[(2, 0)],  # host 0 <- device 2 (3), before device 2 is zeroed
        blocks_to_swap_in=[(0, 5), (1, 3)],  # device 5 <- host 0 after the swap out; device 3 <- 101
        blocks_to_copy=[(3, 6), (7, 1)],  # the copy sees the swapped-in 101; device 1 <- 8 before 7 is zeroed
        new_block_ids_to_zero=[2, 7],
    ))
    assert result.req_ids == [] and result.step == 0
    assert block_values(runner.kv_cache) == [1, 8, 0, 101, 5, 3, 101, 0]
    assert block_values(runner.host_cache) == [3, 101, 102, 103]


def test_zeroing_covers_every_layer_and_both_k_and_v(model_dir):
    runner = ModelRunner(model_dir)
    runner.init_cache(WorkerInit(block_size=2, num_gpu_blocks=4, num_cpu_blocks=0,
                                 max_model_len=8, seed=0))
    runner.poison_cache()
    runner.execute(block_step(3, new_block_ids_to_zero=[1, 3]))
    assert torch.all(runner.kv_cache[:, :, [1, 3]] == 0)
    assert torch.all(torch.isnan(runner.kv_cache[:, :, [0, 2]]))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_request_resumes_with_the_tokens_it_would_have_produced(model_dir, mode):
    prompts = random_prompts([11, 6, 15], vocab_size=512, seed=21)

    def run(preempt: bool) -> dict[str, list[int]]:
        scheduler = TrivialScheduler(ModelRunner(model_dir), num_gpu_blocks=24)
        for i, prompt in enumerate(prompts):
            scheduler.add(f"r{i}", prompt, 12, arrival_step=i)
        if preempt:
            scheduler.preempt("r1", mode, at_step=5, resume_step=8)
            # r2's new blocks reuse r1's freed ones while r1's data is still on the host.
            scheduler.runner.poison_cache()
        return scheduler.run()

    assert run(preempt=True) == run(preempt=False)


def test_a_cpu_cache_is_not_written_at_start_and_a_fresh_block_is_zeroed_when_handed_out(model_dir):
    # The default 1 GiB + 1 GiB, zero-filled at allocation, took 1-3.5 s of every start; the
    # zeroing rule (new_block_ids_to_zero) is what cleans a block before its first write.
    import psutil

    runner = ModelRunner(model_dir)
    blocks = runner.max_gpu_blocks(16)
    before = psutil.Process().memory_info().rss
    runner.init_cache(WorkerInit(block_size=16, num_gpu_blocks=blocks, num_cpu_blocks=blocks,
                                 max_model_len=64, seed=0))
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() >= 1 << 30
    assert psutil.Process().memory_info().rss - before < 64 << 20  # 2 GiB reserved, not resident
    runner.kv_cache[:, :, 7] = float("nan")  # what an uninitialised or reused block may hold
    runner.execute(block_step(0, new_block_ids_to_zero=[7]))
    assert torch.count_nonzero(runner.kv_cache[:, :, 7]) == 0


def test_a_cpu_cache_larger_than_the_available_memory_is_named_at_start(model_dir, monkeypatch, caplog):
    # unwritten, it would not fail at start but kill the worker as it fills
    import psutil

    runner = ModelRunner(model_dir)
    need = 2 * 16 * runner.block_bytes(16)
    real = psutil.virtual_memory

    def available(fits: bool):
        return lambda: real()._replace(available=need if fits else need - 1)

    for fits in (True, False):
        monkeypatch.setattr(psutil, "virtual_memory", available(fits))
        caplog.clear()
        runner.init_cache(WorkerInit(block_size=16, num_gpu_blocks=16, num_cpu_blocks=16, max_model_len=64, seed=0))
        warned = [r.getMessage() for r in caplog.records if "KV caches" in r.getMessage()]
        assert bool(warned) == (not fits)
    assert "--kv-cache-memory-gib" in warned[0] and "--swap-space" in warned[0]
