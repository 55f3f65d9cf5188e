"""A step applied and gathered while the one before it samples (ModelRunner._prepare_ahead),
its decodes' placeholders filled from that step's samples: the same tokens as without it."""

import pytest

from pagedserve.protocol.messages import DecodeBatch, SamplingParams, SchedulerOutput, WorkerInit
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.input_batch import BatchError
from pagedserve.worker_proc.model_runner import ModelRunner
from support.scheduler_sim import StepDriver, request
from support.worker_harness import random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model_dir(tmp_path_factory.mktemp("m") / "m", "qwen2", num_layers=2))


class RunnerWorker:
    """The worker process's loop in one call: the step queued behind this one is its peek."""

    def __init__(self, runner: ModelRunner, peek: bool):
        self.runner, self.peek, self.driver = runner, peek, None

    def step(self, out):
        queued = self.driver.pending
        return self.runner.execute(out, peek=(lambda: queued[0] if queued else None) if self.peek else None)


def run(model_dir: str, peek: bool) -> tuple[dict, ModelRunner, int]:
    cfg = SchedulerConfig(block_size=4, num_gpu_blocks=128, max_num_seqs=6, max_num_batched_tokens=64,
                          max_model_len=256, debug_invariants=True)
    runner = ModelRunner(model_dir)
    runner.init_cache(WorkerInit(block_size=4, num_gpu_blocks=128, num_cpu_blocks=0, max_model_len=256, seed=0))
    sched = Scheduler(cfg)
    worker = RunnerWorker(runner, peek)
    driver = worker.driver = StepDriver(sched, worker, ahead=True)
    prompts = random_prompts([5, 11, 3, 17, 8, 2, 9, 6], vocab_size=512, seed=3)
    for i, prompt in enumerate(prompts):  # greedy and seeded sampling; more requests than seats
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.8, seed=i)
        sched.add_request(request(f"r{i}", prompt, max_tokens=6 + 3 * i, **sampling))
    streams: dict = {}
    while driver.busy():
        for delta in driver.step()[2]:
            streams.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return streams, runner, driver.steps_ahead


def test_steps_prepared_ahead_give_the_tokens_of_steps_prepared_in_turn(model_dir):
    ahead, runner, steps_ahead = run(model_dir, peek=True)
    in_turn, plain_runner, _ = run(model_dir, peek=False)
    assert ahead == in_turn
    assert steps_ahead > 10 and runner.steps_prepared_ahead >= steps_ahead - 1
    assert plain_runner.steps_prepared_ahead == 0


def first_step(model_dir: str):
    """A runner, and the first step of one request (a prefill that samples)."""
    runner = ModelRunner(model_dir)
    runner.init_cache(WorkerInit(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, max_model_len=64, seed=0))
    sched = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=16, max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=64))
    sched.add_request(request("a", [5, 6, 7], max_tokens=4, temperature=0.0))
    first = sched.schedule()
    return runner, first


def test_a_step_that_cannot_apply_fails_in_its_own_turn(model_dir):
    runner, first = first_step(model_dir)
    bad = SchedulerOutput(step=first.step + 1, new_requests=[], cached_requests=[],
                          decodes=DecodeBatch(req_ids=["nobody"], num_computed_tokens=[3], token_ids=[-1],
                                              new_blocks=[]),
                          finished_req_ids=[], blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[],
                          new_block_ids_to_zero=[], total_num_scheduled_tokens=1)

    result = runner.execute(first, peek=lambda: bad)

    assert result.req_ids == ["a"] and len(result.sampled_token_ids) == 1 and result.error is None
    with pytest.raises(BatchError, match="nobody"):
        runner.execute(bad)


def test_a_step_out_of_order_is_left_to_the_loop(model_dir):
    runner, first = first_step(model_dir)
    runner.execute(first, peek=lambda: first)  # a duplicated frame: the worker's loop refuses it
    assert runner.steps_prepared_ahead == 0
