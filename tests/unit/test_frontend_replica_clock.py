"""A replica's freshness is judged up to the last time the frontend read its socket: while its
own loop is busy (a long request's preparation) and stats wait unread, no replica turns stale;
once everything is read, a replica that stopped sending does."""

import asyncio

import zmq
import zmq.asyncio

from pagedserve.client.router import Router
from pagedserve.frontend_proc.zmq_async import AsyncReceiver
from pagedserve.protocol.messages import SchedulerStats, SchedulerToFrontend
from pagedserve.protocol.zmq_io import Sender

TIMEOUT_S = 5.0


def test_stats_waiting_unread_keep_a_replica_fresh_and_silence_does_not(tmp_path):
    async def run() -> list[bool]:
        now = [0.0]
        ctx, send_ctx = zmq.asyncio.Context(), zmq.Context()
        receiver = AsyncReceiver(ctx, f"ipc://{tmp_path}/outputs", SchedulerToFrontend, clock=lambda: now[0])
        sender = Sender(send_ctx, receiver.endpoint)
        router = Router(1, TIMEOUT_S)
        router.clock = receiver.read_up_to
        live = []
        try:
            sender.send(SchedulerStats(replica=0, state="ready", pid=10))
            router.update(await receiver.recv(), now=now[0])
            live.append(router.any_live())

            now[0] = 10.0  # the loop was busy for 10 s, and the replica sent stats meanwhile
            sender.send(SchedulerStats(replica=0, state="ready", pid=10))
            assert await receiver.sock.poll(5000)  # arrived, not read
            live.append(router.any_live())

            router.update(await receiver.recv(), now=now[0])
            live.append(router.any_live())

            now[0] = 10.0 + TIMEOUT_S + 1  # everything read, and the replica has been silent since
            live.append(router.any_live())
        finally:
            receiver.close()
            sender.close()
            ctx.term()
            send_ctx.term()
        return live

    assert asyncio.run(run()) == [True, True, True, False]
