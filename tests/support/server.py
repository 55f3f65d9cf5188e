"""Starts a real pagedserve deployment (supervisor + children) for end-to-end tests."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from pagedserve.deploy.fork_client import ADDRESS_ENV, ForkServerConnection


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux; 32768 otherwise)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int = 1) -> int:
    """A base port whose next ``count`` ports are all free now, chosen below the ephemeral range:
    a port there is never taken meanwhile as the local end of some outgoing connection (gloo's,
    a worker's), which is how a port picked by bind(0) was lost before a deployment bound it."""
    rng = random.SystemRandom()
    top = _ephemeral_low() - count
    for _ in range(100):
        base = rng.randrange(10000, top) if top > 10000 else rng.randrange(1024, 65536 - count)
        held = []
        try:
            for port in range(base, base + count):
                sk = socket.socket()
                held.append(sk)
                sk.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sk in held:
                sk.close()
    raise RuntimeError("no free port range")


def free_port() -> int:
    return free_port_range(1)


def pagedserve_processes(run_dir_parent: str) -> list[psutil.Process]:
    """Every live process started for the deployment whose run dirs live under this parent."""
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "pagedserve" in cmd and run_dir_parent in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


_session_fork_server: ForkServerConnection | None = None


def session_fork_server() -> str:
    """The address of this pytest process's listening fork server, started on first use; it
    exits with this process (its parent's end closes)."""
    global _session_fork_server
    if _session_fork_server is None or not _session_fork_server.alive():
        # a short private dir: a unix socket's path holds at most 107 bytes
        _session_fork_server = ForkServerConnection(listen=os.path.join(tempfile.mkdtemp(prefix="pfs-"), "fork.sock"))
        atexit.register(_stop_session_fork_server, _session_fork_server)
    return _session_fork_server.address


def _stop_session_fork_server(server: ForkServerConnection) -> None:
    server.close()
    shutil.rmtree(os.path.dirname(server.address), ignore_errors=True)


@dataclass
class Server:
    model: str
    args: list[str] = field(default_factory=list)
    run_dir_parent: str = ""
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    env: dict = field(default_factory=dict)  # extra environment for the whole deployment (None: unset)
    cwd: str | None = None  # the deployment's working directory (this process's by default)
    # ``pagedserve serve`` as a user types it (the console script) instead of ``python -m``
    console_script: bool = False
    # False: its processes are forked from this pytest process's listening fork server, loaded
    # once for all of them (deploy/fork_client.py); True: from one of its own, as `serve` alone does.
    own_fork_server: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, tmp: Path, timeout_s: float = 180.0) -> "Server":
        self.port = self.port or free_port()
        self.run_dir_parent = str(tmp / "run")
        os.makedirs(self.run_dir_parent, exist_ok=True)
        self.log_path = tmp / f"server-{self.port}.log"
        entry = ([str(Path(sys.executable).parent / "pagedserve")] if self.console_script
                 else [sys.executable, "-m", "pagedserve.deploy.cli"])
        cmd = [*entry, "serve", self.model, "--port", str(self.port), "--run-dir-parent", self.run_dir_parent,
               *self.args]
        shared = {} if self.own_fork_server else {ADDRESS_ENV: session_fork_server()}
        env = {k: v for k, v in {**os.environ, **shared, **self.env}.items() if v is not None}
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=env,
                                     cwd=self.cwd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling the server's readiness, not synchronising on a guess
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:] if self.log_path else ""

    def pids(self) -> list[int]:
        return [p.pid for p in pagedserve_processes(self.run_dir_parent)]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in pagedserve_processes(self.run_dir_parent):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def served_model(srv: Server) -> str:
    """The model name a deployment answers to first (``/v1/models``)."""
    return httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
