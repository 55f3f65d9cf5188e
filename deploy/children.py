"""Child processes of the supervisor: started so they can never outlive it."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Optional, Union

from pagedserve.deploy.fork_client import ForkedProcess, ForkServerConnection, ForkServerError
from pagedserve.deploy.parent_death import die_with_parent


@dataclass
class Child:
    role: str
    replica: int
    rank: int
    popen: Union[subprocess.Popen, ForkedProcess]

    @property
    def name(self) -> str:
        return f"{self.role} {self.replica}.{self.rank} (pid {self.popen.pid})"

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def wait_or_kill(self, timeout_s: float) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def spawn(role: str, replica: int, rank: int, cmd: list[str],
          fork_server: Optional[ForkServerConnection] = None) -> Child:
    """Forked from ``fork_server`` where one is given and can, else exec'd."""
    if fork_server is not None:
        try:
            return Child(role, replica, rank, fork_server.spawn(cmd))
        except ForkServerError:  # said once in the log by the server's connection
            pass
    # Own process group: a terminal's Ctrl-C reaches only the supervisor, which then
    # drains and stops the children in order.
    popen = subprocess.Popen(cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()), process_group=0)
    return Child(role, replica, rank, popen)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
