"""Servers a benchmark starts for itself on 127.0.0.1 and always stops: pagedserve (its
defaults, through ``pagedserve serve``) and ``transformers serve --continuous-batching``.

Each server runs in its own session (process group), so stopping it ends the supervisor and
every child it started, and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedserve_command(model: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "pagedserve.deploy.cli", "serve", model, "--host", "127.0.0.1",
            "--port", str(port), *extra]


def transformers_command(model: str, port: int, device: str = "cpu") -> list[str]:
    code = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    return [sys.executable, "-c", code, "serve", model, "--continuous-batching", "--device", device,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


class BenchServer:
    """One server process group: ``with BenchServer(name, cmd_for_port, log_dir) as s: s.url``."""

    def __init__(self, name: str, command, log_dir: str, ready_path: str = "/health",
                 timeout_s: float = 180.0, poll_s: float = 0.25):
        self.name = name
        self.port = free_port()
        self.command = command(self.port)
        self.log_path = Path(log_dir) / f"{name}-{self.port}.log"
        self.ready_path = ready_path
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "BenchServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=os.environ.copy())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)  # polling readiness: there is no event to wait on across processes
        raise RuntimeError(f"{self.name} not ready after {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group this server leads: it and its children
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout_s)
                # the leader is gone; its children may linger a moment in the same group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                pass
            break
        self.proc = None
