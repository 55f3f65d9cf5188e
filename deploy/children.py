"""Child processes of the supervisor: started so they can never outlive it."""

from __future__ import annotations

import functools
import os
import random
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


# Ports handed to another process to bind later (torch.distributed's rendezvous, the Ray hosts' servers) come from
# below the kernel's ephemeral range: a port the kernel picks for bind(0) or an outgoing connection could be taken
# by any such socket between our check and the other process's bind (a tensor-parallel pair under Ray once failed
# so, EADDRINUSE), while a port below the range is only ever taken by an explicit bind to it.
_PORTS_FROM = 20000
_PORT_TRIES = 64


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` nothing listens on now, below the ephemeral range where one is free (else any)."""
    low = _ephemeral_low()
    for port in random.sample(range(_PORTS_FROM, low), min(_PORT_TRIES, max(0, low - _PORTS_FROM))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
