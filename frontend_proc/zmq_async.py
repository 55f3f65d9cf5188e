"""An asyncio variant of protocol.zmq_io.Receiver (same framing, limits and checks).

Sending needs no variant: PUSH sockets with an unlimited queue never block, so the
frontend uses protocol.zmq_io.Sender as is.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from pagedserve.protocol.codec import MAX_FRAME_BYTES, Decoder, ProtocolError
from pagedserve.protocol.zmq_io import apply_security

log = logging.getLogger(__name__)
T = TypeVar("T")


def _socket(ctx: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return sock


class AsyncReceiver(Generic[T]):
    """PULL socket, bound; frames that fail to decode are logged, counted and skipped."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, union: Any):
        self.endpoint = endpoint
        self.sock = _socket(ctx, zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self._release = apply_security(ctx, self.sock, endpoint, bind=True)  # CURVE on TCP
        self.sock.bind(endpoint)
        self.decoder: Decoder[T] = Decoder(union)
        self.num_rejected = 0

    async def recv(self) -> T:
        while True:
            frame = await self.sock.recv(copy=True)
            try:
                return self.decoder.decode(frame)
            except ProtocolError as exc:
                self.num_rejected += 1
                log.warning("rejected frame on %s: %s", self.endpoint, exc)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._release()
