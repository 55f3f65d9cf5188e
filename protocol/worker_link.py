"""The scheduler <-> worker channel: one ROUTER per replica (scheduler), one DEALER per worker.

Only the intended peer receives a step, and only it can answer one:

- A PUSH socket round-robins over every peer connected to it, so a stray PULL on a
  worker's input took every other step; a PULL for results took a fake StepResult from
  anyone. A ROUTER completes the ZMTP handshake only with a DEALER or ROUTER: a stray
  PUSH or PULL never gets a frame in or out.
- Each worker's DEALER connects with a routing id ``b"w" + rank + nonce + MAC(key, rank +
  nonce)``. The ROUTER drops every frame whose routing id lacks a valid MAC or whose
  message names another rank, sends steps only to the routing id whose ``WorkerHello`` it
  accepted last for each rank, and drops results from any other (a replaced worker's).
- The key is ``RUN_DIR/peer.key`` (0600 in the 0700 run dir) on ipc and plain loopback
  TCP. On a CURVE endpoint the ZAP handler already admits only the deployment's client
  key, so the key is that client public key, and a worker node needs no extra file.

Cost: bench/scripts/link_bench.py (numbers in bench/log/2026-11-23.md, "Worker channel").
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from typing import Optional

import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.curve import CLIENT, load_key
from pagedserve.protocol.zmq_io import Endpoints, FrameCheck, apply_security, bounded_socket, wait_readable

PEER_KEY_FILE = "peer.key"
_NONCE_BYTES = 8
_MAC_BYTES = 16


class PeerUnreachable(ConnectionError):
    """A worker this replica sends steps to has no live connection (or never said hello)."""


def _peer_key(endpoints: Endpoints, replica: int) -> bytes:
    endpoint = endpoints.workers(replica)
    if endpoint.curve_dir is not None:
        public_file = endpoint.curve_dir / f"{CLIENT}.key"
        public, _ = load_key(endpoint.curve_dir, CLIENT, secret=not public_file.is_file())
        return public
    return _run_dir_key(endpoints.run_dir)


def _run_dir_key(run_dir: Path) -> bytes:
    """The run dir's peer key, created by whichever process needs it first (atomically)."""
    path = run_dir / PEER_KEY_FILE
    if not path.is_file():
        tmp = run_dir / f".{PEER_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)  # fails if another process won the race: use its key
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return path.read_bytes()


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:_MAC_BYTES]


def mint_routing_id(key: bytes, rank: int) -> bytes:
    body = b"w" + rank.to_bytes(2, "big") + secrets.token_bytes(_NONCE_BYTES)
    return body + _mac(key, body)


def verified_rank(key: bytes, routing_id: bytes) -> Optional[int]:
    """The rank a routing id was minted for with ``key``; None for any other id."""
    if len(routing_id) != 3 + _NONCE_BYTES + _MAC_BYTES or routing_id[:1] != b"w":
        return None
    body, mac = routing_id[:-_MAC_BYTES], routing_id[-_MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, body)):
        return None
    return int.from_bytes(body[1:3], "big")


class WorkerRouter:
    """Scheduler side: steps to exactly this replica's workers, their answers from them only."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, replica: int, tp_size: int):
        self.endpoint = endpoints.workers(replica)
        self.tp_size = tp_size
        self.key = _peer_key(endpoints, replica)
        self.sock = bounded_socket(ctx, zmq.ROUTER, self.endpoint)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished worker raises, not a silent drop
        self._release = apply_security(ctx, self.sock, self.endpoint, bind=True)
        self.sock.bind(self.endpoint)
        self.check: FrameCheck = FrameCheck(self.endpoint, m.WorkerToScheduler)
        self.peers: dict[int, bytes] = {}  # rank -> routing id of its accepted WorkerHello
        self._known: dict[bytes, int] = {}  # verified routing ids (a MAC per frame costs ~1 µs)
        self.last_frame: bytes = b""

    def broadcast(self, data: bytes) -> None:
        """The same bytes to the worker of every rank."""
        for rank in range(self.tp_size):
            peer = self.peers.get(rank)
            if peer is None:
                raise PeerUnreachable(f"worker rank {rank} has not said hello on {self.endpoint}")
            try:
                self.sock.send_multipart([peer, data], copy=False)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                raise PeerUnreachable(f"worker rank {rank} disconnected from {self.endpoint}") from None

    def forget_peers(self) -> None:
        """After a worker failure: answers from the old workers are dropped from now on."""
        self.peers.clear()
        self._known.clear()

    def _rank_of(self, routing_id: bytes) -> Optional[int]:
        rank = self._known.get(routing_id)
        if rank is None:
            rank = verified_rank(self.key, routing_id)
            if rank is not None and len(self._known) < 4 * self.tp_size + 16:
                self._known[routing_id] = rank
        return rank

    def _accept(self, parts: list) -> Optional[object]:
        if len(parts) != 2:
            self.check.reject(f"{len(parts)}-part message")
            return None
        routing_id, frame = parts
        rank = self._rank_of(routing_id)
        if rank is None or not 0 <= rank < self.tp_size:
            self.check.reject("a peer that is not a worker of this replica (routing id without a valid MAC)")
            return None
        msg = self.check.decode(frame)
        if msg is None:
            return None
        if msg.rank != rank:
            self.check.reject(f"a {type(msg).__name__} for rank {msg.rank} from rank {rank}'s worker")
            return None
        if isinstance(msg, m.WorkerHello):
            self.peers[rank] = routing_id
        elif self.peers.get(rank) != routing_id:
            self.check.reject(f"a {type(msg).__name__} from a replaced worker of rank {rank}")
            return None
        self.last_frame = frame
        return msg

    def recv(self, timeout_ms: Optional[float] = None) -> Optional[object]:
        """The next accepted message, or None when none came within the timeout (a stream
        of rejected frames does not extend it)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while wait_readable(self.sock, deadline, self.check.log):
            msg = self._accept(self.sock.recv_multipart(copy=True))
            if msg is not None:
                return msg
        return None

    def recv_nowait(self) -> list:
        out = []
        while (msg := self.recv(timeout_ms=0)) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self._release()


class SchedulerLink:
    """Worker side: one DEALER carrying steps in and answers out."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, replica: int, rank: int):
        self.endpoint = endpoints.workers(replica)
        self.sock = bounded_socket(ctx, zmq.DEALER, self.endpoint)
        self.sock.setsockopt(zmq.ROUTING_ID, mint_routing_id(_peer_key(endpoints, replica), rank))
        self._release = apply_security(ctx, self.sock, self.endpoint, bind=False)
        self.sock.connect(self.endpoint)
        self.check: FrameCheck = FrameCheck(self.endpoint, m.SchedulerToWorker)
        self._closed = False

    def recv(self, timeout_ms: Optional[float] = None):
        """The next valid step or control message (None only when a timeout passed)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while wait_readable(self.sock, deadline, self.check.log):
            msg = self.check.decode(self.sock.recv(copy=True))
            if msg is not None:
                return msg
        return None

    def send(self, msg) -> None:
        self.sock.send(encode(msg), copy=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close(linger=0)
            self._release()
