"""An asyncio variant of protocol.zmq_io.Receiver (same framing, limits, checks and queue bound).

Sending needs no variant: the frontend's sends never wait (protocol.zmq_io.Sender.try_send,
see engine_client.py), so plain synchronous sockets serve.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from pagedserve.protocol.zmq_io import FrameCheck, apply_security, bounded_socket

T = TypeVar("T")


class AsyncReceiver(Generic[T]):
    """PULL socket, bound; frames that fail to decode are counted, logged (rate-limited) and skipped."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, union: Any, clock=time.monotonic):
        self.endpoint = endpoint
        self.sock = bounded_socket(ctx, zmq.PULL, endpoint)
        self._release = apply_security(ctx, self.sock, endpoint, bind=True)  # CURVE on TCP
        self.sock.bind(endpoint)
        self.check: FrameCheck[T] = FrameCheck(endpoint, union)
        self.clock = clock
        self._caught_up_at = self.clock()  # the last time no frame waited unread

    @property
    def num_rejected(self) -> int:
        return self.check.num_rejected

    def read_up_to(self) -> float:
        """A time by which every frame sent here had been read: now, unless frames wait unread
        (this process's loop was busy), then the last time none did."""
        if self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            return self._caught_up_at
        return self.clock()

    async def recv(self) -> T:
        while True:
            if not self.sock.get(zmq.EVENTS) & zmq.POLLIN:
                self._caught_up_at = self.clock()
            if not await self.sock.poll(1000):
                self.check.log.flush()  # a flood's last summary line, once it is over
                continue
            msg = self.check.decode(await self.sock.recv(copy=True))
            if msg is not None:
                return msg

    def close(self) -> None:
        self.sock.close(linger=0)
        self._release()
