"""The one small ZeroMQ helper: private run dirs, endpoint names, typed push/pull sockets.

Endpoints default to ``ipc://`` paths inside a 0700 run directory, unique per
deployment, so two instances never collide and no other user can connect. An operator
can instead put them on TCP (``host:port_base+k``, for workers on other nodes): the
supervisor writes that layout to ``RUN_DIR/endpoints.json`` and every process that
reads the run dir follows it. Off loopback the layout must use CurveZMQ (protocol/curve.py).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

import zmq

from pagedserve.protocol.codec import MAX_FRAME_BYTES, Decoder, ProtocolError, encode
from pagedserve.protocol.curve import CURVE_DIR, generate_curve_keys, secure_socket

log = logging.getLogger(__name__)
T = TypeVar("T")


def make_run_dir(parent: Optional[str] = None) -> Path:
    """A fresh private directory (mode 0700) for this deployment's ipc sockets."""
    path = Path(tempfile.mkdtemp(prefix="pagedserve-", dir=parent))
    os.chmod(path, 0o700)
    return path


def ipc_endpoint(run_dir: str | Path, name: str) -> str:
    return f"ipc://{Path(run_dir) / name}.sock"


class Endpoint(str):
    """An endpoint address; ``curve_dir`` is set when its sockets must use CurveZMQ."""

    curve_dir: Optional[Path]

    def __new__(cls, address: str, curve_dir: Optional[Path] = None) -> "Endpoint":
        obj = super().__new__(cls, address)
        obj.curve_dir = curve_dir
        return obj


LAYOUT_FILE = "endpoints.json"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


@dataclass(frozen=True, slots=True)
class TcpLayout:
    """Internal endpoints on ``host:port_base+k``; k is fixed by role, replica and rank."""

    host: str
    port_base: int
    tp_size: int
    num_replicas: int
    curve: bool

    def __post_init__(self) -> None:
        if not self.curve and not is_loopback(self.host):
            raise ValueError(f"internal host {self.host!r} is not a loopback address: "
                             f"its endpoints must use CurveZMQ (curve=True)")
        last = self.port_base + self.num_ports() - 1
        if self.port_base < 1 or last > 65535:
            raise ValueError(f"internal ports {self.port_base}..{last} are not all TCP ports")

    def num_ports(self) -> int:
        return 2 + self.num_replicas * (2 + self.tp_size)

    def port(self, index: int) -> int:
        return self.port_base + index


def write_tcp_layout(run_dir: str | Path, layout: TcpLayout) -> None:
    """Put this deployment's endpoints on TCP (and generate CURVE keys when asked)."""
    if layout.curve:
        generate_curve_keys(run_dir)
    path = Path(run_dir) / LAYOUT_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(layout), f)


class Endpoints:
    """Names of every internal endpoint of one deployment, derived from its run dir."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        layout_path = self.run_dir / LAYOUT_FILE
        self.tcp: Optional[TcpLayout] = (
            TcpLayout(**json.loads(layout_path.read_text())) if layout_path.is_file() else None)

    def _endpoint(self, name: str, index: int) -> Endpoint:
        if self.tcp is None:
            return Endpoint(ipc_endpoint(self.run_dir, name))
        curve_dir = self.run_dir / CURVE_DIR if self.tcp.curve else None
        return Endpoint(f"tcp://{self.tcp.host}:{self.tcp.port(index)}", curve_dir)

    def _replica_index(self, replica: int, offset: int) -> int:
        if self.tcp is not None and not 0 <= replica < self.tcp.num_replicas:
            raise ValueError(f"replica {replica} is not in this deployment's "
                             f"{self.tcp.num_replicas} replica(s) ({self.run_dir / LAYOUT_FILE})")
        tp_size = self.tcp.tp_size if self.tcp is not None else 1
        return 2 + replica * (2 + tp_size) + offset

    def supervisor(self) -> Endpoint:
        return self._endpoint("supervisor", 0)

    def frontend_outputs(self) -> Endpoint:
        return self._endpoint("frontend-out", 1)

    def scheduler_inputs(self, replica: int) -> Endpoint:
        return self._endpoint(f"sched{replica}-in", self._replica_index(replica, 0))

    def worker_results(self, replica: int) -> Endpoint:
        return self._endpoint(f"sched{replica}-results", self._replica_index(replica, 1))

    def worker_inputs(self, replica: int, rank: int) -> Endpoint:
        return self._endpoint(f"sched{replica}-w{rank}", self._replica_index(replica, 2 + rank))


def apply_security(ctx: zmq.Context, sock: zmq.Socket, endpoint: str, bind: bool) -> Callable[[], None]:
    """CURVE setup for endpoints that need it (before bind/connect); returns the release hook."""
    curve_dir = getattr(endpoint, "curve_dir", None)
    if curve_dir is None:
        return lambda: None
    return secure_socket(ctx, sock, curve_dir, bind)


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
        self._release = apply_security(ctx, self.sock, endpoint, bind)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    def send(self, msg: Any) -> bytes:
        data = encode(msg)
        self.sock.send(data, copy=False)
        return data

    def send_bytes(self, data: bytes) -> None:
        self.sock.send(data, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._release()


class Receiver(Generic[T]):
    """PULL socket that decodes one channel's union; bad frames are logged and skipped."""

    def __init__(self, ctx: zmq.Context, endpoint: str, union: Any, bind: bool = True,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self.endpoint = endpoint
        self.sock = _socket(ctx, zmq.PULL, max_frame_bytes)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self._release = apply_security(ctx, self.sock, endpoint, bind)
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
        self._release()
