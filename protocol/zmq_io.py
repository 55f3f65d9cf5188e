"""The one small ZeroMQ helper: private run dirs, endpoint names, typed push/pull sockets.

Endpoints default to ``ipc://`` paths inside a 0700 run directory, unique per
deployment, so two instances never collide and no other user can connect. An operator
can instead put them on TCP (``host:port_base+k``, for workers on other nodes): the
supervisor writes that layout to ``RUN_DIR/endpoints.json`` and every process that
reads the run dir follows it. Off loopback the layout must use CurveZMQ (protocol/curve.py).

Every queue is bounded (``*_HWM``, in messages per connection: libzmq counts messages,
not bytes), so a peer that floods a socket costs bounded memory: the receiver stops
reading from that connection and the sender blocks (``send``) or drops (``try_send``).
Bad frames are counted and logged at most once a second per socket (rate_limited_log.py).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

import zmq

from pagedserve.protocol.codec import MAX_FRAME_BYTES, Decoder, ProtocolError, encode
from pagedserve.protocol.curve import CURVE_DIR, generate_curve_keys, secure_socket
from pagedserve.protocol.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
T = TypeVar("T")

# Queue limits per connection, in messages. The sender holds its own backlog (up to
# the channel's HWM); a receiver holds at most RECEIVE_HWM per connection, so what a flood
# costs a receiver does not grow with the sender's allowance. Normal load never reaches
# them: the scheduler drains its input every step, the frontend reads outputs as they
# come, a worker has one step (two with overlap) in flight.
RECEIVE_HWM = 1_000
REQUEST_HWM = 10_000  # frontend -> scheduler: AddRequest / AbortRequest; full = 503 to the client
OUTPUT_HWM = 10_000  # scheduler -> frontend: one RequestOutputs per step + stats; full = the scheduler waits
CONTROL_HWM = 1_000  # anyone -> supervisor, supervisor -> frontend: heartbeats and tables, a few per second
WORKER_HWM = 100  # scheduler <-> worker (protocol/worker_link.py)


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
    hwm: int  # queue limit of the sockets on this endpoint, in messages per connection

    def __new__(cls, address: str, curve_dir: Optional[Path] = None, hwm: int = CONTROL_HWM) -> "Endpoint":
        obj = super().__new__(cls, address)
        obj.curve_dir = curve_dir
        obj.hwm = hwm
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
    """Internal endpoints on ``host:port_base+k``; k is fixed by role, replica and rank.

    ``addresses`` (endpoint name -> ``tcp://host:port``) overrides that rule per endpoint:
    with the Ray backend each replica binds on whichever node Ray placed it
    (deploy/ray/supervisor.py), so one host and one port range cannot name them all.
    """

    host: str
    port_base: int
    tp_size: int
    num_replicas: int
    curve: bool
    addresses: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        hosts = [self.host] + [a.rsplit(":", 1)[0].removeprefix("tcp://") for a in self.addresses.values()]
        if not self.curve and not all(is_loopback(h) for h in hosts):
            raise ValueError(f"internal host {self.host!r} is not a loopback address: "
                             f"its endpoints must use CurveZMQ (curve=True)")
        last = self.port_base + self.num_ports() - 1
        if self.port_base < 1 or last > 65535:
            raise ValueError(f"internal ports {self.port_base}..{last} are not all TCP ports")

    def num_ports(self) -> int:
        return 2 + self.num_replicas * 2

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

    def _endpoint(self, name: str, index: int, hwm: int) -> Endpoint:
        if self.tcp is None:
            return Endpoint(ipc_endpoint(self.run_dir, name), hwm=hwm)
        curve_dir = self.run_dir / CURVE_DIR if self.tcp.curve else None
        address = self.tcp.addresses.get(name) or f"tcp://{self.tcp.host}:{self.tcp.port(index)}"
        return Endpoint(address, curve_dir, hwm)

    def _replica_index(self, replica: int, offset: int) -> int:
        if self.tcp is not None and not 0 <= replica < self.tcp.num_replicas:
            raise ValueError(f"replica {replica} is not in this deployment's "
                             f"{self.tcp.num_replicas} replica(s) ({self.run_dir / LAYOUT_FILE})")
        return 2 + replica * 2 + offset

    def supervisor(self) -> Endpoint:
        return self._endpoint("supervisor", 0, CONTROL_HWM)

    def frontend_outputs(self) -> Endpoint:
        return self._endpoint("frontend-out", 1, OUTPUT_HWM)

    def scheduler_inputs(self, replica: int) -> Endpoint:
        return self._endpoint(f"sched{replica}-in", self._replica_index(replica, 0), REQUEST_HWM)

    def workers(self, replica: int) -> Endpoint:
        """The replica's scheduler <-> worker channel: steps out, results in (worker_link.py)."""
        return self._endpoint(f"sched{replica}-workers", self._replica_index(replica, 1), WORKER_HWM)


def apply_security(ctx: zmq.Context, sock: zmq.Socket, endpoint: str, bind: bool) -> Callable[[], None]:
    """CURVE setup for endpoints that need it (before bind/connect); returns the release hook."""
    curve_dir = getattr(endpoint, "curve_dir", None)
    if curve_dir is None:
        return lambda: None
    return secure_socket(ctx, sock, curve_dir, bind)


def bounded_socket(ctx: zmq.Context, kind: int, endpoint: str,
                   max_frame_bytes: int = MAX_FRAME_BYTES) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Oversized frames are dropped by libzmq (the peer is disconnected) before they
    # reach Python; ProtocolError covers anything under the limit that is malformed.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    hwm = getattr(endpoint, "hwm", CONTROL_HWM)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, min(hwm, RECEIVE_HWM))
    return sock


class FrameCheck(Generic[T]):
    """Decodes one channel's frames; a bad frame is counted, logged (rate-limited) and None."""

    def __init__(self, endpoint: str, union: Any, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.endpoint = endpoint
        self.decoder: Decoder[T] = Decoder(union, max_frame_bytes)
        self.log = RateLimitedLog(log)
        self.kind = f"rejected frame on {endpoint}"

    @property
    def num_rejected(self) -> int:
        return self.log.total(self.kind)

    def reject(self, reason: str) -> None:
        self.log.warning(self.kind, reason)

    def decode(self, frame: bytes) -> Optional[T]:
        try:
            msg = self.decoder.decode(frame)
        except ProtocolError as exc:
            self.reject(str(exc))
            return None
        self.log.flush()  # a flood that is mixed with good traffic still gets its summary lines
        return msg


IDLE_FLUSH_S = 1.0


def wait_readable(sock: zmq.Socket, deadline: Optional[float], rejections: RateLimitedLog) -> bool:
    """Poll until a frame can be read (True) or ``deadline`` (monotonic; None: never)
    passes (False). While idle, the rate-limited log writes what it held back."""
    while True:
        left_s = IDLE_FLUSH_S if deadline is None else min(IDLE_FLUSH_S, deadline - time.monotonic())
        # Rounded up: truncated, the last millisecond before the deadline polled with timeout 0
        # again and again (~80 polls a wait), a busy spin in every loop that waits with a timeout
        if sock.poll(max(0, math.ceil(left_s * 1000))):
            return True
        rejections.flush()
        if deadline is not None and time.monotonic() >= deadline:
            return False


class Sender:
    """PUSH socket that encodes messages (or forwards pre-encoded bytes).

    ``send`` waits while the peer's queue is full (backpressure); ``try_send`` drops the
    message instead and says so, for periodic messages whose next copy supersedes it.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, bind: bool = False,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self.endpoint = endpoint
        self.sock = bounded_socket(ctx, zmq.PUSH, endpoint, max_frame_bytes)
        self._release = apply_security(ctx, self.sock, endpoint, bind)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self._drops = RateLimitedLog(log)

    def send(self, msg: Any) -> bytes:
        data = encode(msg)
        self.sock.send(data, copy=False)
        return data

    def send_bytes(self, data: bytes) -> None:
        self.sock.send(data, copy=False)

    def try_send(self, msg: Any) -> bool:
        """Send unless the queue is full; False (counted, logged) when the message was dropped."""
        try:
            self.sock.send(encode(msg), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self._drops.warning(f"queue to {self.endpoint} full, dropped", type(msg).__name__)
            return False

    def close(self) -> None:
        self.sock.close(linger=0)
        self._release()


class Receiver(Generic[T]):
    """PULL socket that decodes one channel's union; bad frames are logged and skipped."""

    def __init__(self, ctx: zmq.Context, endpoint: str, union: Any, bind: bool = True,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self.endpoint = endpoint
        self.sock = bounded_socket(ctx, zmq.PULL, endpoint, max_frame_bytes)
        self._release = apply_security(ctx, self.sock, endpoint, bind)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.check: FrameCheck[T] = FrameCheck(endpoint, union, max_frame_bytes)
        self.last_frame: bytes = b""

    @property
    def num_rejected(self) -> int:
        return self.check.num_rejected

    @property
    def decoder(self) -> Decoder[T]:
        return self.check.decoder

    @decoder.setter
    def decoder(self, decoder: Decoder[T]) -> None:
        """A channel may swap in its own decoder (e.g. one that remembers rejected requests)."""
        self.check.decoder = decoder

    def recv(self, timeout_ms: Optional[float] = None) -> Optional[T]:
        """The next valid message, or None if none arrives within the timeout (a stream of
        bad frames does not extend it)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while wait_readable(self.sock, deadline, self.check.log):
            frame = self.sock.recv(copy=True)
            msg = self.check.decode(frame)
            if msg is not None:
                self.last_frame = frame
                return msg
        return None

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
