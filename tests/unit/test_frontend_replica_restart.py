"""The frontend's engine client fails a replica's in-flight requests when its scheduler's pid
changes: a restarted scheduler knows none of them. Real sockets in a private run dir, no processes."""

from __future__ import annotations

import asyncio

import zmq

from pagedserve.frontend_proc.engine_client import EngineClient, ReplicaFailed
from pagedserve.client.router import Router
from pagedserve.protocol.messages import (AbortRequest, AddRequest, FrontendStarted, FrontendToScheduler,
                                          SamplingParams, SchedulerStats)
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir
from support.frontend_harness import poll


def add(request_id: str) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=4),
                      eos_token_ids=[2])


def test_a_new_scheduler_pid_fails_that_replicas_in_flight_requests_and_aborts_them_there(tmp_path):
    endpoints = Endpoints(make_run_dir(str(tmp_path)))
    ctx = zmq.Context()
    schedulers = [Receiver(ctx, endpoints.scheduler_inputs(r), FrontendToScheduler) for r in range(2)]

    async def scenario():
        router = Router(2, timeout_s=30.0)
        client = EngineClient(endpoints, router)
        client.start()
        heartbeats = Sender(ctx, endpoints.frontend_outputs())
        try:
            for replica, pid in ((0, 100), (1, 200)):
                heartbeats.send(SchedulerStats(replica=replica, state="ready", pid=pid))
            await poll(lambda: all(r.stats is not None for r in router.replicas))
            first = client.submit(add("a"))
            second = client.submit(add("b"))  # the router spreads them: one per replica
            on_0, on_1 = sorted((first, second), key=lambda h: h.replica)
            assert (on_0.replica, on_1.replica) == (0, 1)

            heartbeats.send(SchedulerStats(replica=0, state="ready", pid=100, step=7))  # same process
            await poll(lambda: router.replicas[0].stats.step == 7)
            assert not on_0.pending and client.num_in_flight() == 2

            heartbeats.send(SchedulerStats(replica=0, state="ready", pid=101))  # restarted
            [event] = await asyncio.wait_for(on_0.take(), 5.0)
            assert isinstance(event, ReplicaFailed) and "restarted (pid 100 -> 101)" in event.message
            assert on_0.done and not on_1.done and not on_1.pending
            assert router.replicas[0].in_flight == 0 and router.replicas[1].in_flight == 1
        finally:
            heartbeats.close()
            await client.close()

    try:
        asyncio.run(scenario())
        received = [schedulers[0].recv(timeout_ms=5000) for _ in range(3)]
        # a frontend's first message to a replica says it started (a restarted one's replicas end the old requests)
        assert [type(m) for m in received] == [FrontendStarted, AddRequest, AbortRequest]
        assert received[2].request_ids == [received[1].request_id]
    finally:
        for rx in schedulers:
            rx.close()
        ctx.term()
