"""The one small ZeroMQ helper: private run dirs, endpoint names, typed push/pull sockets.

Endpoints default to ``ipc://`` paths inside a 0700 run directory, unique per
deployment, so two instances never collide and no other user can connect.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Generic, Optional, TypeVar

import zmq

from pagedserve.protocol.codec import MAX_FRAME_BYTES, Decoder, ProtocolError, encode

log = logging.getLogger(__name__)
T = TypeVar("T")


def make_run_dir(parent: Optional[str] = None) -> Path:
    """A fresh private directory (mode 0700) for this deployment's ipc sockets."""
    path = Path(tempfile.mkdtemp(prefix="pagedserve-", dir=parent))
    os.chmod(path, 0o700)
    return path


def ipc_endpoint(run_dir: str | Path, name: str) -> str:
    return f"ipc://{Path(run_dir) / name}.sock"


class Endpoints:
    """Names of every internal endpoint of one deployment, derived from its run dir."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    def supervisor(self) -> str:
        return ipc_endpoint(self.run_dir, "supervisor")

    def frontend_outputs(self) -> str:
        return ipc_endpoint(self.run_dir, "frontend-out")

    def scheduler_inputs(self, replica: int) -> str:
        return ipc_endpoint(self.run_dir, f"sched{replica}-in")

    def worker_inputs(self, replica: int, rank: int) -> str:
        return ipc_endpoint(self.run_dir, f"sched{replica}-w{rank}")

    def worker_results(self, replica: int) -> str:
        return ipc_endpoint(self.run_dir, f"sched{replica}-results")


def _socket(ctx: zmq.Context, kind: int, max_frame_bytes: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Oversized frames are dropped by libzmq (the peer is disconnected) before they
    # reach Python; ProtocolError covers anything under the limit that is malformed.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    return sock


class Sender:
    """PUSH socket that encodes messages (or forwards pre-encoded bytes)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, bind: bool = False,
                 max_frame_bytes: int = MAX_FRAME_BYTES, sndhwm: int = 0):
        self.endpoint = endpoint
        self.sock = _socket(ctx, zmq.PUSH, max_frame_bytes)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    def send(self, msg: Any) -> bytes:
        data = encode(msg)
        self.sock.send(data, copy=False)
        return data

    def send_bytes(self, data: bytes) -> None:
        self.sock.send(data, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class Receiver(Generic[T]):
    """PULL socket that decodes one channel's union; bad frames are logged and skipped."""

    def __init__(self, ctx: zmq.Context, endpoint: str, union: Any, bind: bool = True,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self.endpoint = endpoint
        self.sock = _socket(ctx, zmq.PULL, max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.decoder: Decoder[T] = Decoder(union, max_frame_bytes)
        self.num_rejected = 0
        self.last_frame: bytes = b""

    def poll(self, timeout_ms: Optional[float]) -> bool:
        return bool(self.sock.poll(None if timeout_ms is None else int(timeout_ms)))

    def recv(self, timeout_ms: Optional[float] = None) -> Optional[T]:
        """The next valid message, or None if none arrives within the timeout."""
        while True:
            if timeout_ms is not None and not self.sock.poll(int(timeout_ms)):
                return None
            frame = self.sock.recv(copy=True)
            try:
                msg = self.decoder.decode(frame)
            except ProtocolError as exc:
                self.num_rejected += 1
                log.warning("rejected frame on %s: %s", self.endpoint, exc)
                continue
            self.last_frame = frame
            return msg

    def recv_nowait(self) -> list[T]:
        out: list[T] = []
        while True:
            msg = self.recv(timeout_ms=0)
            if msg is None:
                return out
            out.append(msg)

    def close(self) -> None:
        self.sock.close(linger=0)
