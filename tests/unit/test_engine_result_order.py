"""The replica engine's wait for a step's results (scheduler_proc/engine.py), over real sockets in one
process: with two steps in flight (async scheduling), one rank can finish the next step before
another rank's result for this step has come in. That result is kept for its step, not dropped:
dropping it hung the replica until the step timeout (seen under load with two CPU ranks)."""

from __future__ import annotations

import logging
import threading

import pytest
import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.worker_link import SchedulerLink
from pagedserve.protocol.zmq_io import Endpoints, make_run_dir
from pagedserve.scheduler_proc.engine import EngineLoop
from pagedserve.scheduler_proc.engine import WorkerFailure
from pagedserve.scheduler_proc.engine_config import EngineConfig
from support.server import wait_until

NO_DECODES = m.DecodeBatch([], [], [], [])


def sent_step(n: int) -> m.SchedulerOutput:
    return m.SchedulerOutput(n, [], [], NO_DECODES, [], [], [], [], [], 0)


@pytest.fixture
def connected(tmp_path):
    """connected(ranks): an engine of that many ranks and a worker link per rank, each rank's hello
    received; everything closed after the test."""
    ctx, made = zmq.Context(), []

    def connect(ranks: int) -> tuple[EngineLoop, list[SchedulerLink]]:
        run_dir = make_run_dir(str(tmp_path))
        engine = EngineLoop(EngineConfig(run_dir=run_dir, tensor_parallel_size=ranks), ctx)
        workers = [SchedulerLink(ctx, Endpoints(run_dir), replica=0, rank=r) for r in range(ranks)]
        made.append((engine, workers))
        for rank, w in enumerate(workers):
            w.send(m.WorkerHello(rank, 1234, "cpu", "model", 2, 4096, 10))
        assert set(engine._recv_from_workers(m.WorkerHello, 5.0)) == set(range(ranks))
        engine.worker_pids.clear()  # the hello's pid is no process of this test
        return engine, workers

    yield connect
    for engine, workers in made:
        for w in workers:
            w.close()
        engine.close()
    ctx.term()


def test_a_result_of_the_next_step_that_overtakes_another_ranks_is_kept_for_its_step(connected, caplog):
    caplog.set_level(logging.WARNING)
    engine, workers = connected(2)
    engine.pending.extend([sent_step(1), sent_step(2)])  # two steps in flight
    first: dict = {}
    waiting = threading.Thread(target=lambda: first.update(engine._recv_from_workers(m.StepResult, 10.0, step=1)))
    # rank 0 finishes steps 1 and 2, and the engine has read both, before rank 1's step 1 comes in
    workers[0].send(m.StepResult(1, 0, ["a"], [7]))
    workers[0].send(m.StepResult(2, 0, ["a"], [8]))
    waiting.start()
    wait_until(lambda: (2, 0) in engine.early or "ignoring a result for step 2" in caplog.text, timeout_s=10)
    workers[1].send(m.StepResult(1, 1, [], []))
    workers[1].send(m.StepResult(2, 1, [], []))
    waiting.join()
    assert {rank: r.step for rank, r in first.items()} == {0: 1, 1: 1}
    engine.pending.popleft()
    second = engine._recv_from_workers(m.StepResult, 3.0, step=2)  # dropped, it was a WorkerFailure
    assert second[0].sampled_token_ids == [8] and {r.step for r in second.values()} == {2}
    assert engine.early == {} and "ignoring" not in caplog.text


def test_a_result_of_a_step_never_sent_is_still_ignored(connected, caplog):
    """Only in-flight steps are kept: a stray or stale result cannot pile up."""
    engine, (worker,) = connected(1)
    engine.pending.append(sent_step(1))
    worker.send(m.StepResult(9, 0, [], []))
    with pytest.raises(WorkerFailure):
        engine._recv_from_workers(m.StepResult, 0.5, step=1)
    assert engine.early == {} and "ignoring a result for step 9 while waiting for step 1" in caplog.text
