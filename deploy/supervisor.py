"""Starts the frontend, one scheduler per replica and one worker per device; watches them.

Children are started with a parent-death signal, so even a SIGKILLed supervisor leaves
no orphans holding device memory. A replica whose workers fail is restarted with backoff;
one that keeps failing is marked failed (the frontend's /health says so) instead of
flapping. SIGTERM drains: the frontend stops admitting and finishes what is in flight.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import time
from typing import Optional

import zmq

from pagedserve.deploy.children import Child
from pagedserve.deploy.launcher import Launcher, StartupError, dist_init_address
from pagedserve.deploy.restart_policy import RestartBudget, RestartSchedule
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.protocol import messages as m
from pagedserve.protocol.rate_limited_log import RateLimitedLog
from pagedserve.protocol.zmq_io import (Endpoints, Receiver, Sender, TcpLayout, make_run_dir,
                                        write_tcp_layout)

log = logging.getLogger("pagedserve.supervisor")

FRONTEND = -1  # the frontend's unit in the restart budget (replicas are 0, 1, ...)
DRAIN_GRACE_S = 5.0  # the frontend's own grace after --drain-timeout-s (frontend_proc/drain.py)
PUBLISH_INTERVAL_S = 1.0


__all__ = ["Supervisor", "StartupError", "serve"]


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.run_dir = str(make_run_dir(cfg.run_dir_parent))
        layout = self._layout()
        if layout is not None:  # every process reads it from the run dir
            write_tcp_layout(self.run_dir, layout)
        self.ep = Endpoints(self.run_dir)
        self.ctrl: Receiver = Receiver(self.ctx, self.ep.supervisor(), m.ToSupervisor)
        self.to_frontend = Sender(self.ctx, self.ep.frontend_outputs())
        self.frontend: Optional[Child] = None
        self.launcher = Launcher(cfg, self.run_dir, self.ctrl)
        self.schedulers = self.launcher.schedulers
        self.workers = self.launcher.workers
        self.budget = RestartBudget(cfg.max_restarts, cfg.restart_window_s)
        self.pending_restart = RestartSchedule(self.budget)  # replicas waiting out their backoff
        self.restart_what: dict[int, str] = {}  # replica -> "workers" | "replica"
        self.failed: set[int] = set()
        self.last_heartbeat: dict[int, float] = {}  # replica -> when its scheduler last said so
        self.stop_requested = False
        self.last_publish = 0.0
        self.stray_log = RateLimitedLog(log)  # whatever a flood of control messages may say

    def _layout(self) -> Optional[TcpLayout]:
        return self.cfg.tcp_layout()

    def _tick(self) -> None:
        """Per loop turn, during startup and after: nothing for local children (the Ray
        backend advances its placements here)."""

    # ------------------------------------------------------------------ spawning

    def _spawn_workers(self, replica: int) -> None:
        if self.cfg.remote_workers:
            self._write_worker_commands(replica, dist_init_address(self.cfg.tensor_parallel_size))
            self.workers[replica] = []
            return
        self.launcher.spawn_workers(replica)

    def _write_worker_commands(self, replica: int, dist_init: Optional[str]) -> None:
        """--remote-workers: the operator runs these (deploy/README.md, "Beyond one node")."""
        path = os.path.join(self.run_dir, "worker-commands.sh")
        lines = [shlex.join(self.cfg.worker_cmd(self.run_dir, replica, rank, dist_init))
                 for rank in range(self.cfg.tensor_parallel_size)]
        with open(path, "a") as f:
            f.write("".join(f"{line} &\n" for line in lines))
        log.warning("--remote-workers: start replica %d's workers yourself (commands in %s):\n%s",
                    replica, path, "\n".join(lines))

    def _spawn_replica(self, replica: int) -> None:
        self.launcher.spawn_scheduler(replica)
        self.last_heartbeat[replica] = time.monotonic()  # startup counts against the timeout too
        self._spawn_workers(replica)

    def start(self, timeout_s: float = 600.0) -> None:
        self.frontend = self.launcher.spawn_other("frontend", FRONTEND, self.cfg.frontend_cmd(self.run_dir))
        for replica in range(self.cfg.data_parallel_size):
            self._spawn_replica(replica)
        self.launcher.wait_ready(self.launcher.expected() | {("frontend", FRONTEND, 0)}, timeout_s,
                                 children=self.children, on_message=self._note_heartbeat, tick=self._tick,
                                 stopped=lambda: self.stop_requested)
        log.info("pagedserve ready on http://%s:%d (model %s, %d replica(s) x %d worker(s), run dir %s)",
                 self.cfg.host, self.cfg.port, self.cfg.served_model_name[0],
                 self.cfg.data_parallel_size, self.cfg.tensor_parallel_size, self.run_dir)

    def children(self) -> list[Child]:
        return ([self.frontend] if self.frontend else []) + self.launcher.children()

    def _note_heartbeat(self, msg) -> None:
        if isinstance(msg, m.Heartbeat):
            self.last_heartbeat[msg.replica] = time.monotonic()

    # ------------------------------------------------------------------ restarts

    def _schedule_restart(self, replica: int, what: str, reason: str) -> None:
        if replica in self.failed or replica in self.pending_restart:
            return
        self.launcher.forget_dead_workers(replica)
        delay = self.pending_restart.schedule(replica, time.monotonic())
        if delay is None:
            log.error("replica %d failed %d times within %.0fs (%s); marking it failed",
                      replica, self.cfg.max_restarts + 1, self.cfg.restart_window_s, reason)
            self.failed.add(replica)
            for child in [self.schedulers.get(replica), *self.workers.get(replica, [])]:
                if child:
                    child.kill()
            self.last_publish = 0.0  # tell the frontend now, not at the next tick
            return
        log.warning("replica %d: restarting %s in %.1fs (%s)", replica, what, delay, reason)
        self.restart_what[replica] = what
        for child in self.workers.get(replica, []):
            child.kill()
        if what == "replica" and replica in self.schedulers:
            self.schedulers[replica].kill()

    def _do_pending_restarts(self) -> None:
        for replica in self.pending_restart.take_due(time.monotonic()):
            if self.restart_what.get(replica) == "replica":
                self._keep_trace(replica)
                self._spawn_replica(replica)
            else:
                self._spawn_workers(replica)

    def _keep_trace(self, replica: int) -> None:
        """A restarted scheduler records afresh at its path: what it recorded before the crash (what
        an operator most needs then) is moved aside to PATH.partK first, not overwritten."""
        path = self.cfg.trace_path(replica)
        if path is None or not os.path.exists(path):
            return
        part = 1
        while os.path.exists(f"{path}.part{part}"):
            part += 1
        try:
            os.replace(path, f"{path}.part{part}")
            log.warning("replica %d restarts: its trace so far is kept as %s.part%d", replica, path, part)
        except OSError as exc:
            log.error("replica %d restarts: its trace so far could not be kept (%s); it is overwritten", replica, exc)

    def _restart_frontend(self) -> None:
        code = self.frontend.popen.returncode
        delay = self.budget.next_delay(FRONTEND, time.monotonic())
        if delay is None:
            raise RuntimeError(f"the frontend exited with code {code} more than "
                               f"{self.cfg.max_restarts} times within {self.cfg.restart_window_s:.0f}s")
        log.error("frontend exited with code %s; restarting it in %.1fs", code, delay)
        time.sleep(delay)  # nothing else can be served without a frontend meanwhile
        self.frontend = self.launcher.spawn_other("frontend", FRONTEND, self.cfg.frontend_cmd(self.run_dir))

    def _watch_children(self) -> None:
        if self.frontend and self.frontend.popen.poll() is not None:
            self._restart_frontend()
        for replica, sched in self.schedulers.items():
            if sched.popen.poll() is not None and replica not in self.pending_restart and replica not in self.failed:
                self._schedule_restart(replica, "replica", f"scheduler exited with code {sched.popen.returncode}")
        now = time.monotonic()
        for replica, sched in self.schedulers.items():
            silent = now - self.last_heartbeat.get(replica, now)
            if (silent > self.cfg.scheduler_timeout_s and sched.popen.poll() is None
                    and replica not in self.pending_restart and replica not in self.failed):
                self._schedule_restart(replica, "replica", f"scheduler alive but silent for {silent:.1f}s (hung)")
        for replica in self.workers:
            if replica in self.pending_restart or replica in self.failed:
                self.launcher.forget_dead_workers(replica)
                continue
            dead = self.launcher.unreported_dead_worker(replica, now)
            if dead is not None:
                self._schedule_restart(replica, "workers", f"{dead.name} exited with code "
                                       f"{dead.popen.returncode} and its scheduler did not report it")

    def _publish(self) -> None:
        """The process table and failed replicas, for the frontend's /health."""
        now = time.monotonic()
        if now - self.last_publish < PUBLISH_INTERVAL_S:
            return
        self.last_publish = now
        for replica in self.failed:
            self.to_frontend.try_send(m.SchedulerStats(replica=replica, state="failed"))
        num = self.cfg.data_parallel_size
        self.to_frontend.try_send(m.ProcessTable(
            supervisor_pid=os.getpid(),
            processes=[m.ProcessInfo(c.role, c.replica, c.rank, c.popen.pid, c.popen.poll() is None,
                                     getattr(c, "node", ""))
                       for c in self.children()],
            replica_restarts=[self.budget.restarts_in_window(r, now) for r in range(num)],
            failed_replicas=sorted(self.failed)))

    def _handle_control(self, msg) -> None:
        if isinstance(msg, m.RestartWorkers):
            if msg.replica not in self.workers:
                self.stray_log.warning("ignoring RestartWorkers for an unknown replica", "replica %d", msg.replica)
            else:
                self._schedule_restart(msg.replica, "workers", msg.reason)
        elif isinstance(msg, m.Heartbeat):
            self.last_heartbeat[msg.replica] = time.monotonic()

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        while not self.stop_requested:
            msg = self.ctrl.recv(timeout_ms=100)
            if msg is not None:
                self._handle_control(msg)
            self._tick()
            self._watch_children()
            self._do_pending_restarts()
            self._publish()
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
                # the frontend ends what still runs at the deadline, then closes (frontend_proc/drain.py)
                self.frontend.popen.wait(self.cfg.drain_timeout_s + DRAIN_GRACE_S + 5)
            except Exception:
                pass
        self._stop_children()
        self.ctrl.close()  # stops its CURVE authenticator thread, if any
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for replica in range(self.cfg.data_parallel_size):
            path = self.cfg.trace_path(replica)
            if path is not None and os.path.exists(path):
                log.info("trace written to %s", path)
        log.info("pagedserve stopped")
        return 0

    def _stop_children(self) -> None:
        self.launcher.stop([self.frontend] if self.frontend else [])


def serve(cfg: ServeConfig, supervisor_class: type = Supervisor) -> int:
    sup = supervisor_class(cfg)
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
