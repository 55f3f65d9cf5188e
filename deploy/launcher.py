"""Starts a deployment's schedulers and workers, waits for their ProcessReady, replaces dead workers.

The one copy of these rules: the supervisor (``serve``), the offline ``LLM`` and replay all
start processes through it, so a worker replaced under ``serve`` is replaced the same way
under ``LLM``, and a child that exits during startup fails every one of them at once.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

from pagedserve.deploy.children import Child, free_tcp_port, spawn
from pagedserve.deploy.fork_client import ForkServerConnection, acquire_fork_server, release_fork_server
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.protocol import messages as m
from pagedserve.protocol.zmq_io import Receiver

# A dead worker is normally reported by its scheduler within half a second (RestartWorkers);
# if none comes (the scheduler was still waiting for its workers' hello), replace them anyway.
WORKER_REPORT_GRACE_S = 3.0
POLL_MS = 200

Process = tuple[str, int, int]  # (role, replica, rank), as ProcessReady names it


class StartupError(RuntimeError):
    """A process exited, or was not ready in time, while starting."""


def dist_init_address(tensor_parallel_size: int) -> Optional[str]:
    """Where one replica's workers meet for torch.distributed (a single worker needs none)."""
    return f"tcp://127.0.0.1:{free_tcp_port()}" if tensor_parallel_size > 1 else None


def spawn_workers(replica: int, tensor_parallel_size: int, worker_cmd: Callable[[int, Optional[str]], list[str]],
                  fork_server: Optional[ForkServerConnection] = None) -> list[Child]:
    """One replica's workers; ``worker_cmd(rank, dist_init)`` is each one's command line."""
    dist_init = dist_init_address(tensor_parallel_size)
    return [spawn("worker", replica, rank, worker_cmd(rank, dist_init), fork_server)
            for rank in range(tensor_parallel_size)]


def wait_for(pending: set, recv: Callable[[int], object], children: Callable[[], Iterable[Child]],
             timeout_s: float, accept: Callable[[object], None], *, what: str = "ProcessReady",
             tick: Optional[Callable[[], None]] = None, stopped: Callable[[], bool] = lambda: False) -> None:
    """Receives until ``accept`` has emptied ``pending`` (``what`` names the awaited message);
    a child that exits meanwhile, or the deadline, raises StartupError rather than waiting on a
    process that cannot answer."""
    deadline = time.monotonic() + timeout_s
    while pending:
        if stopped():
            raise StartupError("interrupted during startup")
        if tick is not None:
            tick()
        for child in children():
            if child.popen.poll() is not None:
                raise StartupError(f"{child.name} exited with code {child.popen.returncode} "
                                   f"while waiting for {what}")
        if time.monotonic() > deadline:
            raise StartupError(f"no {what} after {timeout_s:.0f}s from {sorted(pending)}")
        msg = recv(POLL_MS)
        if msg is not None:
            accept(msg)


def stop_children(children: Iterable[Child], grace_s: float = 5.0) -> None:
    """SIGTERM to all, then SIGKILL to whoever is still running after the grace."""
    children = list(children)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait_or_kill(max(0.1, deadline - time.monotonic()))


class Launcher:
    """One deployment's schedulers and workers, started from ``cfg``'s command lines into
    ``run_dir``; ``control`` is the socket their ProcessReady and RestartWorkers arrive on.
    On CPU they are forked from the fork server (fork_client.py), which starts loading here."""

    def __init__(self, cfg: ServeConfig, run_dir: str, control: Receiver):
        self.cfg, self.run_dir, self.control = cfg, run_dir, control
        self.fork_server: Optional[ForkServerConnection] = acquire_fork_server(cfg.device)
        self.schedulers: dict[int, Child] = {}
        self.workers: dict[int, list[Child]] = {}
        self._worker_dead_since: dict[int, float] = {}  # replica -> when a dead worker was first seen

    def children(self) -> list[Child]:
        return [*self.schedulers.values(), *(w for ws in self.workers.values() for w in ws)]

    def expected(self) -> set[Process]:
        """Every process of every replica, as ProcessReady names it."""
        tp = self.cfg.tensor_parallel_size
        out: set[Process] = set()
        for replica in range(self.cfg.data_parallel_size):
            out.add(("scheduler", replica, 0))
            out.update(("worker", replica, rank) for rank in range(tp))
        return out

    def spawn_workers(self, replica: int) -> None:
        self._worker_dead_since.pop(replica, None)
        self.workers[replica] = spawn_workers(
            replica, self.cfg.tensor_parallel_size,
            lambda rank, dist_init: self.cfg.worker_cmd(self.run_dir, replica, rank, dist_init), self.fork_server)

    def spawn_scheduler(self, replica: int) -> None:
        self.schedulers[replica] = spawn("scheduler", replica, 0, self.cfg.scheduler_cmd(self.run_dir, replica),
                                         self.fork_server)

    def spawn_other(self, role: str, unit: int, cmd: list[str]) -> Child:
        """A process of the deployment other than a replica's (the supervisor's frontend)."""
        return spawn(role, unit, 0, cmd, self.fork_server)

    def wait_ready(self, expected: set[Process], timeout_s: float, *,
                   children: Optional[Callable[[], Iterable[Child]]] = None,
                   on_message: Callable[[object], None] = lambda msg: None,
                   tick: Optional[Callable[[], None]] = None, stopped: Callable[[], bool] = lambda: False) -> None:
        """Until each of ``expected`` said ProcessReady; other messages go to ``on_message``."""
        def accept(msg) -> None:
            if isinstance(msg, m.ProcessReady):
                expected.discard((msg.role, msg.replica, msg.rank))
            else:
                on_message(msg)

        wait_for(expected, self.control.recv, children or self.children, timeout_s, accept,
                 tick=tick, stopped=stopped)

    def unreported_dead_worker(self, replica: int, now: float) -> Optional[Child]:
        """A worker of ``replica`` dead for longer than the grace without its scheduler saying so."""
        dead = [w for w in self.workers.get(replica, []) if w.popen.poll() is not None]
        if not dead:
            self._worker_dead_since.pop(replica, None)
            return None
        if now - self._worker_dead_since.setdefault(replica, now) > WORKER_REPORT_GRACE_S:
            return dead[0]
        return None

    def forget_dead_workers(self, replica: int) -> None:
        """Their restart is already scheduled (or the replica failed): start the grace afresh."""
        self._worker_dead_since.pop(replica, None)

    def replace_workers(self, replica: int) -> None:
        for child in self.workers.get(replica, []):
            child.kill()
        self.spawn_workers(replica)

    def stop(self, others: Iterable[Child] = ()) -> None:
        """Stops these children and ``others`` (the supervisor's frontend), then gives the fork
        server back: the last deployment using it stops it."""
        stop_children([*others, *self.children()])
        release_fork_server(self.fork_server)
        self.fork_server = None
