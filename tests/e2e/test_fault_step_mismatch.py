"""A worker answer that does not fit its step (StepResultMismatch) is a worker failure: the
scheduler fails the requests in flight, asks the supervisor for fresh workers, keeps running,
and then serves again. A real scheduler process; the test plays the supervisor, the frontend and
a worker that speaks the ROUTER/DEALER link (protocol/worker_link.py) with a real model runner,
but whose first answer carries a sample for a request that was not scheduled."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.protocol import messages as m
from pagedserve.protocol.worker_link import SchedulerLink
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

TIMEOUT_S = 60


def expect(rx, kind: type, where: str):
    """The next message of ``kind`` (heartbeats and stats in between are skipped)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        msg = rx.recv(timeout_ms=left * 1000)
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} from the scheduler on {where} within {TIMEOUT_S} s")


def connect_worker(ctx: zmq.Context, ep: Endpoints, runner: ModelRunner) -> SchedulerLink:
    """A fresh worker (a new routing id, as a restarted process would have) that says hello."""
    link = SchedulerLink(ctx, ep, replica=0, rank=0)
    link.send(m.WorkerHello(rank=0, pid=os.getpid(), device="cpu", model_id=runner.model_id,
                            num_layers=runner.num_layers, block_bytes=runner.block_bytes(16),
                            max_gpu_blocks=64))
    init = expect(link, m.WorkerInit, "the worker link")
    runner.init_cache(init)
    link.send(m.WorkerReady(rank=0, num_gpu_blocks=init.num_gpu_blocks, num_cpu_blocks=init.num_cpu_blocks))
    return link


def deltas_for(frontend: Receiver, request_id: str) -> list[m.RequestDelta]:
    """Every delta of ``request_id`` up to its finish."""
    got = []
    while not got or got[-1].finish_reason is None:
        outputs = expect(frontend, m.RequestOutputs, "frontend outputs")
        got += [d for d in m.iter_deltas(outputs) if d.request_id == request_id]
    return got


def deltas_for_step(frontend: Receiver, request_id: str) -> list[m.RequestDelta]:
    """The deltas of ``request_id`` in the next RequestOutputs."""
    outputs = expect(frontend, m.RequestOutputs, "frontend outputs")
    return [d for d in m.iter_deltas(outputs) if d.request_id == request_id]


def test_a_step_result_that_does_not_fit_its_step_fails_the_request_and_the_replica_serves_again(tmp_path):
    model = str(build_model_dir(tmp_path / "model", "qwen2"))
    run_dir = make_run_dir(str(tmp_path))
    ep, ctx = Endpoints(run_dir), zmq.Context()
    supervisor = Receiver(ctx, ep.supervisor(), m.ToSupervisor)
    frontend = Receiver(ctx, ep.frontend_outputs(), m.SchedulerToFrontend)
    # One step in flight at a time, so that each answer below belongs to the step just received.
    scheduler = subprocess.Popen([sys.executable, "-m", "pagedserve.scheduler_proc", "--run-dir", str(run_dir),
                                  "--model", model, "--replica", "0", "--num-gpu-blocks", "32",
                                  "--max-model-len", "256", "--no-async-scheduling", "--log-level", "WARNING"],
                                 stderr=subprocess.PIPE, text=True)
    inputs = Sender(ctx, ep.scheduler_inputs(0))
    links: list[SchedulerLink] = []
    prompts = random_prompts([7, 9], vocab_size=512, seed=4)
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        expect(supervisor, m.ProcessReady, "the supervisor socket")
        runner = ModelRunner(model)
        links.append(worker := connect_worker(ctx, ep, runner))
        inputs.send(m.AddRequest("lost", prompts[0], m.SamplingParams(**greedy), [2]))
        result = runner.execute(expect(worker, m.SchedulerOutput, "the worker link"))
        result.req_ids.append("never-scheduled")
        result.sampled_token_ids.append(5)
        worker.send(result)

        (lost,) = deltas_for(frontend, "lost")
        assert lost.finish_reason == "error" and lost.new_token_ids == []
        assert "does not fit its step" in lost.error
        assert "does not fit its step" in expect(supervisor, m.RestartWorkers, "the supervisor socket").reason
        assert scheduler.poll() is None, "the scheduler exited on a bad worker answer instead of replacing the worker"

        runner = ModelRunner(model)  # the fresh worker the supervisor would start
        links.append(worker := connect_worker(ctx, ep, runner))
        inputs.send(m.AddRequest("served", prompts[1], m.SamplingParams(**greedy), [2]))
        served = []
        while not served or served[-1].finish_reason is None:
            worker.send(runner.execute(expect(worker, m.SchedulerOutput, "the worker link")))
            served += deltas_for_step(frontend, "served")
        assert served[-1].finish_reason == "length"
        assert [t for d in served for t in d.new_token_ids] == hf_greedy(model, [prompts[1]], 4)[0]
    finally:
        scheduler.terminate()
        _, stderr = scheduler.communicate(timeout=10)
        for link in links:
            link.close()
        for sock in (supervisor, frontend, inputs):
            sock.close()
        ctx.term()
    assert "does not fit its step" in stderr, "the rejected answer was not logged"
