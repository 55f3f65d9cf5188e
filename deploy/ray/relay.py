"""Each replica's request channel, relayed from a fixed address on the serve node to wherever
Ray placed the replica.

The frontend connects once, at startup, to one address per replica. A replica that Ray
places again after a lost node comes back on another node with another address, so the
supervisor binds that fixed address itself and forwards every frame to the replica's
current scheduler (``point``). Frames for a replica that has no scheduler are dropped: the
frontend has already failed the requests they belong to, and a new scheduler must not run
requests nobody waits for (a frame still on its way when the replica is pointed at its
new node may get through: the new scheduler runs it and the frontend ignores the answers
for a request it no longer holds). A full scheduler queue holds its frame here and stops reading
that replica's input, so the frontend's own queue fills and it answers 503 as without Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import zmq

from pagedserve.protocol.zmq_io import Endpoint, apply_security, bounded_socket

_CONTROL = "inproc://pagedserve-ray-relay"
POINT_TIMEOUT_S = 5.0
log = logging.getLogger("pagedserve.ray")


class InputRelay(threading.Thread):
    def __init__(self, ctx: zmq.Context, listen: dict[int, Endpoint]):
        super().__init__(name="ray-input-relay", daemon=True)
        self.ctx = ctx
        self.listen = listen
        self._control = ctx.socket(zmq.PAIR)  # used by the supervisor's thread only
        self._control.bind(_CONTROL)
        self._ready = threading.Event()
        self._seq = 0
        self._releases = []

    def start(self) -> None:
        super().start()
        self._ready.wait()

    def point(self, replica: int, endpoint: Optional[Endpoint]) -> None:
        """Forward ``replica``'s frames to ``endpoint`` from now on (None: drop them)."""
        self._seq += 1
        seq = str(self._seq).encode()
        self._control.send_multipart([str(replica).encode(), (endpoint or "").encode(), seq])
        # wait until applied: whatever the frontend sends from now on goes to the new place
        deadline = time.monotonic() + POINT_TIMEOUT_S
        while self._control.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            if self._control.recv() == seq:  # (an answer to an earlier call that timed out is skipped)
                return
        log.error("the request relay took over %.0fs to follow replica %d; it will when it can",
                  POINT_TIMEOUT_S, replica)

    def stop(self) -> None:
        if self.is_alive():
            self._control.send_multipart([b"stop", b"", b""])
            self.join(5)
        self._control.close(linger=0)

    def _connect(self, endpoint: Endpoint) -> zmq.Socket:
        sock = bounded_socket(self.ctx, zmq.PUSH, endpoint)
        self._releases.append(apply_security(self.ctx, sock, endpoint, bind=False))
        sock.connect(endpoint)
        return sock

    def run(self) -> None:
        control = self.ctx.socket(zmq.PAIR)
        control.connect(_CONTROL)
        inputs: dict[zmq.Socket, int] = {}
        for replica, endpoint in self.listen.items():
            sock = bounded_socket(self.ctx, zmq.PULL, endpoint)
            self._releases.append(apply_security(self.ctx, sock, endpoint, bind=True))
            sock.bind(endpoint)
            inputs[sock] = replica
        outputs: dict[int, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        for sock in inputs:
            poller.register(sock, zmq.POLLIN)
        held: dict[int, zmq.Frame] = {}  # replica -> the frame its full queue did not take
        by_replica = {replica: sock for sock, replica in inputs.items()}

        def forward(replica: int, frame) -> None:
            out = outputs.get(replica)
            if out is None:
                return
            try:
                out.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                held[replica] = frame
                poller.unregister(by_replica[replica])

        self._ready.set()
        try:
            while True:
                events = poller.poll(50 if held else None)
                for replica, frame in list(held.items()):
                    del held[replica]
                    poller.register(by_replica[replica], zmq.POLLIN)
                    forward(replica, frame)
                for sock, _ in events:
                    if sock is control:
                        what, address, seq = control.recv_multipart()
                        if what == b"stop":
                            return
                        replica = int(what)
                        old = outputs.pop(replica, None)
                        if old is not None:
                            old.close(linger=0)
                        if held.pop(replica, None) is not None:
                            poller.register(by_replica[replica], zmq.POLLIN)
                        while old is None and by_replica[replica].poll(0):  # sent while it had none
                            by_replica[replica].recv(copy=False)
                        if address:
                            endpoint = self.listen[replica]
                            outputs[replica] = self._connect(
                                Endpoint(address.decode(), endpoint.curve_dir, endpoint.hwm))
                        control.send(seq)
                        continue
                    if inputs.get(sock) not in held:  # unregistered sockets may still be in events
                        forward(inputs[sock], sock.recv(copy=False))
        finally:
            for sock in [*inputs, *outputs.values(), control]:
                sock.close(linger=0)
            for release in self._releases:
                release()
