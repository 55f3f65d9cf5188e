"""Starts the frontend, one scheduler per replica and one worker per device; watches them.

Children are started with a parent-death signal, so even a SIGKILLed supervisor leaves
no orphans holding device memory. A replica whose workers fail is restarted with backoff;
one that keeps failing is marked failed (the frontend's /health says so) instead of
flapping. SIGTERM drains: the frontend stops admitting and finishes what is in flight.
"""

from __future__ import annotations

import logging
import shutil
import signal
import time
from collections import deque
from typing import Optional

import zmq

from pagedserve.deploy.children import Child, free_tcp_port, spawn
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.protocol import messages as m
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir

log = logging.getLogger("pagedserve.supervisor")


class StartupError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.run_dir = str(make_run_dir(cfg.run_dir_parent))
        self.ep = Endpoints(self.run_dir)
        self.ctrl: Receiver = Receiver(self.ctx, self.ep.supervisor(), m.ToSupervisor)
        self.to_frontend = Sender(self.ctx, self.ep.frontend_outputs())
        self.frontend: Optional[Child] = None
        self.schedulers: dict[int, Child] = {}
        self.workers: dict[int, list[Child]] = {}
        self.restart_times: dict[int, deque] = {r: deque() for r in range(cfg.data_parallel_size)}
        self.pending_restart: dict[int, float] = {}  # replica -> when to respawn
        self.restart_what: dict[int, str] = {}  # replica -> "workers" | "replica"
        self.failed: set[int] = set()
        self.stop_requested = False

    # ------------------------------------------------------------------ spawning

    def _spawn_workers(self, replica: int) -> None:
        tp = self.cfg.tensor_parallel_size
        dist_init = f"tcp://127.0.0.1:{free_tcp_port()}" if tp > 1 else None
        self.workers[replica] = [
            spawn("worker", replica, rank, self.cfg.worker_cmd(self.run_dir, replica, rank, dist_init))
            for rank in range(tp)]

    def _spawn_replica(self, replica: int) -> None:
        self.schedulers[replica] = spawn("scheduler", replica, 0, self.cfg.scheduler_cmd(self.run_dir, replica))
        self._spawn_workers(replica)

    def start(self, timeout_s: float = 600.0) -> None:
        self.frontend = spawn("frontend", -1, 0, self.cfg.frontend_cmd(self.run_dir))
        for replica in range(self.cfg.data_parallel_size):
            self._spawn_replica(replica)
        expected = {("frontend", -1, 0)}
        for r in range(self.cfg.data_parallel_size):
            expected.add(("scheduler", r, 0))
            expected.update(("worker", r, k) for k in range(self.cfg.tensor_parallel_size))
        deadline = time.monotonic() + timeout_s
        while expected:
            if self.stop_requested:
                raise StartupError("interrupted during startup")
            for child in self.children():
                if child.popen.poll() is not None:
                    raise StartupError(f"{child.name} exited with code {child.popen.returncode} during startup")
            if time.monotonic() > deadline:
                raise StartupError(f"not ready after {timeout_s:.0f}s: {sorted(expected)}")
            msg = self.ctrl.recv(timeout_ms=200)
            if isinstance(msg, m.ProcessReady):
                expected.discard((msg.role, msg.replica, msg.rank))
        log.info("pagedserve ready on http://%s:%d (model %s, %d replica(s) x %d worker(s), run dir %s)",
                 self.cfg.host, self.cfg.port, self.cfg.served_model_name,
                 self.cfg.data_parallel_size, self.cfg.tensor_parallel_size, self.run_dir)

    def children(self) -> list[Child]:
        out = [self.frontend] if self.frontend else []
        out += list(self.schedulers.values())
        for ws in self.workers.values():
            out += ws
        return out

    # ------------------------------------------------------------------ restarts

    def _schedule_restart(self, replica: int, what: str, reason: str) -> None:
        if replica in self.failed or replica in self.pending_restart:
            return
        now = time.monotonic()
        times = self.restart_times[replica]
        while times and now - times[0] > self.cfg.restart_window_s:
            times.popleft()
        if len(times) >= self.cfg.max_restarts:
            log.error("replica %d failed %d times in %.0fs; marking it failed", replica,
                      len(times) + 1, self.cfg.restart_window_s)
            self.failed.add(replica)
            for child in [self.schedulers.get(replica), *self.workers.get(replica, [])]:
                if child:
                    child.kill()
            return
        times.append(now)
        delay = min(0.5 * 2 ** (len(times) - 1), 10.0) if len(times) > 1 else 0.0
        log.warning("replica %d: restarting %s in %.1fs (%s)", replica, what, delay, reason)
        self.pending_restart[replica] = now + delay
        self.restart_what[replica] = what
        for child in self.workers.get(replica, []):
            child.kill()
        if what == "replica" and replica in self.schedulers:
            self.schedulers[replica].kill()

    def _do_pending_restarts(self) -> None:
        now = time.monotonic()
        for replica, when in list(self.pending_restart.items()):
            if now < when:
                continue
            del self.pending_restart[replica]
            if self.restart_what.get(replica) == "replica":
                self._spawn_replica(replica)
            else:
                self._spawn_workers(replica)

    def _watch_children(self) -> None:
        if self.frontend and self.frontend.popen.poll() is not None:
            raise RuntimeError(f"frontend exited with code {self.frontend.popen.returncode}")
        for replica, sched in self.schedulers.items():
            if sched.popen.poll() is not None and replica not in self.pending_restart and replica not in self.failed:
                self._schedule_restart(replica, "replica", f"scheduler exited with code {sched.popen.returncode}")

    def _publish_failed(self) -> None:
        for replica in self.failed:
            self.to_frontend.send(m.SchedulerStats(replica=replica, state="failed"))

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        last_publish = 0.0
        while not self.stop_requested:
            msg = self.ctrl.recv(timeout_ms=100)
            if isinstance(msg, m.RestartWorkers):
                self._schedule_restart(msg.replica, "workers", msg.reason)
            elif isinstance(msg, m.ProcessFailed):
                log.error("%s %d.%d reported failure: %s", msg.role, msg.replica, msg.rank, msg.reason)
            self._watch_children()
            self._do_pending_restarts()
            if self.failed and time.monotonic() - last_publish > 1.0:
                self._publish_failed()
                last_publish = time.monotonic()
        return self.shutdown(drain=True)

    def request_stop(self, *_args) -> None:
        self.stop_requested = True

    def shutdown(self, drain: bool) -> int:
        if drain and self.frontend and self.frontend.popen.poll() is None:
            # uvicorn's graceful shutdown stops accepting connections and lets in-flight
            # responses finish; the schedulers keep serving them meanwhile.
            log.info("draining: finishing in-flight requests (up to %.0fs)", self.cfg.drain_timeout_s)
            for replica in self.schedulers:
                Sender(self.ctx, self.ep.scheduler_inputs(replica)).send(m.Drain())
            self.frontend.popen.send_signal(signal.SIGTERM)
            try:
                self.frontend.popen.wait(self.cfg.drain_timeout_s + 5)
            except Exception:
                pass
        children = self.children()
        for child in children:
            child.terminate()
        deadline = time.monotonic() + 5
        for child in children:
            child.wait_or_kill(max(0.1, deadline - time.monotonic()))
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.cfg.record_trace:
            log.info("trace written to %s", self.cfg.record_trace)
        log.info("pagedserve stopped")
        return 0


def serve(cfg: ServeConfig) -> int:
    sup = Supervisor(cfg)
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)
    try:
        sup.start()
    except StartupError as exc:
        log.error("startup failed: %s", exc)
        sup.shutdown(drain=False)
        return 1
    try:
        return sup.run()
    except RuntimeError as exc:
        log.error("%s; stopping", exc)
        sup.shutdown(drain=False)
        return 1
