"""The parent's end of the fork server (fork_server.py), and the handle of a child forked there.

One server per parent process, shared by every deployment that process runs on CPU (the
offline ``LLM``s of one program, say) and stopped with the last of them. Started as soon as a
deployment is created, so it loads while the parent goes on; the first spawn waits for it.
A server that fails to start, or runs more than one thread once loaded, is not used: the
children are exec'd as before (``children.spawn``), and the log says why.

``PAGEDSERVE_FORK_SERVER=PATH`` uses one that listens there instead (``fork_server.py
--listen``), loaded once for every deployment on the host: the test suite's servers share one
per pytest worker. ``PAGEDSERVE_START_METHOD=exec`` turns it off. It is off on CUDA: a module
that touches the driver while loading would leave every forked child without CUDA, and that
was not checked on a GPU.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import threading
from typing import Optional

import msgspec

from pagedserve.deploy.entry_points import python_module
from pagedserve.deploy.fork_server import MAX_REQUEST_BYTES, STATUS

log = logging.getLogger("pagedserve.deploy")

READY_TIMEOUT_S = 120.0  # loading torch on a slow disk
START_METHOD_ENV = "PAGEDSERVE_START_METHOD"
ADDRESS_ENV = "PAGEDSERVE_FORK_SERVER"  # a listening fork server to use instead of one of our own


class ForkServerError(RuntimeError):
    """The fork server cannot start a child: start it the usual way."""


class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen`` the deploy code uses."""

    def __init__(self, pid: int, status_fd: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: Optional[int] = None
        self._status_fd = status_fd

    def _readable(self, timeout_s: Optional[float]) -> bool:
        poller = select.poll()
        poller.register(self._status_fd, select.POLLIN)
        return bool(poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))

    def _collect(self) -> None:
        data = os.read(self._status_fd, STATUS.size)
        os.close(self._status_fd)
        # No status: the fork server died before it could reap the child, and the child died
        # with it (its parent-death signal).
        self.returncode = STATUS.unpack(data)[0] if len(data) == STATUS.size else -signal.SIGKILL

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._readable(0):
            self._collect()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not self._readable(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServerConnection:
    """A fork server of this process's own (``listen``: one others may connect to as well), or,
    with ``address``, a connection to one that listens there."""

    def __init__(self, listen: Optional[str] = None, address: Optional[str] = None,
                 allow_modules: tuple[str, ...] = ()):
        self.proc: Optional[subprocess.Popen] = None
        self.address = address or listen
        self.lock = threading.Lock()
        self.users = 0
        self.server_pid = 0
        self._ready: Optional[bool] = None
        self.openmp: dict[str, str] = {}  # what torch's OpenMP was loaded with there
        self._why_not = ""
        if address is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.sock.connect(address)
            except OSError as exc:  # spawns fall back to exec, and the log says why
                self._fail(f"cannot connect to the fork server at {address}: {exc}")
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(python_module("pagedserve.deploy.fork_server", str(theirs.fileno()),
                                                       *(["--listen", listen] if listen else []),
                                                       *(a for m in allow_modules for a in ("--allow-module", m))),
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, process_group=0)
        finally:
            theirs.close()
        self.sock = mine

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else self._ready is not False

    def _fail(self, why: str) -> None:
        self._ready, self._why_not = False, why
        log.warning("not forking processes from the fork server: %s; starting each one with exec", why)

    def _recv(self, timeout_s: float) -> dict:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(MAX_REQUEST_BYTES)
        except (socket.timeout, OSError) as exc:
            raise ForkServerError(f"the fork server did not answer: {exc}") from None
        if not data:
            raise ForkServerError("the fork server exited")
        return msgspec.msgpack.decode(data)

    def _check_ready(self) -> None:
        if self._ready is None:
            try:
                hello = self._recv(READY_TIMEOUT_S)
                if "error" in hello:
                    raise ForkServerError(hello["error"])
                if hello.get("threads", 1) != 1:
                    raise ForkServerError(f"it runs {hello['threads']} threads once loaded, and forking is "
                                          f"safe with one")
                self._ready = True
                self.openmp, self.server_pid = dict(hello.get("openmp", {})), int(hello.get("pid", 0))
                log.info("forking this deployment's processes from the fork server (pid %d; torch loaded with %s)",
                         self.server_pid, " ".join(f"{k}={v}" for k, v in sorted(self.openmp.items())) or "no OMP_*")
            except ForkServerError as exc:
                self._fail(str(exc))
        if not self._ready:
            raise ForkServerError(self._why_not)

    def spawn(self, cmd: list[str]) -> ForkedProcess:
        with self.lock:
            self._check_ready()
            status_r, status_w = os.pipe()
            stdin = os.open(os.devnull, os.O_RDONLY)
            try:
                request = msgspec.msgpack.encode({"argv": cmd, "env": dict(os.environ), "cwd": os.getcwd()})
                socket.send_fds(self.sock, [request], [stdin, 1, 2, status_w])
                reply = self._recv(30.0)
            except (OSError, ForkServerError) as exc:
                os.close(status_r)
                self._ready, self._why_not = False, str(exc)
                raise ForkServerError(str(exc)) from None
            finally:
                os.close(status_w)
                os.close(stdin)
            if "error" in reply:
                os.close(status_r)
                raise ForkServerError(reply["error"])
            return ForkedProcess(int(reply["pid"]), status_r, cmd)

    def close(self) -> None:
        """The server kills what it still runs for this connection; one of our own exits. One
        never used may still be loading: it exits once loaded, without us waiting for it (a
        deployment that failed early, say)."""
        self.sock.close()
        if self.proc is None:
            return
        if self.address is not None:  # ours listened there
            try:
                os.unlink(self.address)
            except FileNotFoundError:
                pass
        if self._ready is None:
            return
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_shared: Optional[ForkServerConnection] = None
_shared_lock = threading.Lock()


def acquire_fork_server(device: str) -> Optional[ForkServerConnection]:
    """The process's fork server for a deployment on ``device`` (started if none runs), or
    None where children are exec'd; give it back with ``release_fork_server``."""
    global _shared
    if device != "cpu" or os.environ.get(START_METHOD_ENV, "forkserver") == "exec":
        return None
    with _shared_lock:
        if _shared is None or not _shared.alive():
            _shared = ForkServerConnection(address=os.environ.get(ADDRESS_ENV) or None)
        _shared.users += 1
        return _shared


def _forget_in_forked_child() -> None:
    # A process this one forks must not hold the server's socket: the server takes its end
    # closing as this process's death only once every copy is closed.
    global _shared
    if _shared is not None:
        _shared.sock.close()
    _shared = None


os.register_at_fork(after_in_child=_forget_in_forked_child)


def release_fork_server(server: Optional[ForkServerConnection]) -> None:
    global _shared
    if server is None:
        return
    with _shared_lock:
        server.users -= 1
        if server.users > 0:
            return
        if _shared is server:
            _shared = None
    server.close()
