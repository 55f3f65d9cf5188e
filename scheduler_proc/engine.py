"""The scheduler process's loop: the only code here that touches sockets.

Each turn: take what the frontend sent, ask the Scheduler for one step, send the same
encoded bytes to every worker, wait for their results, hand the sampled tokens back to
the Scheduler and the resulting deltas to the frontend. Workers that die or stop making
progress end every in-flight request with an explicit error and are replaced.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Optional

import psutil
import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.trace import TraceWriter
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender
from pagedserve.scheduler_proc.engine_config import EngineConfig
from pagedserve.scheduler_proc.frontend_inputs import apply_frontend_message
from pagedserve.scheduler_proc.interval_log import IntervalLog
from pagedserve.scheduler_proc.output_processor import StepResultMismatch
from pagedserve.scheduler_proc.scheduler import Scheduler

log = logging.getLogger("pagedserve.scheduler")


class WorkerFailure(RuntimeError):
    """A worker died, hung past the step timeout, or reported an error."""


class EngineLoop:
    def __init__(self, cfg: EngineConfig, ctx: Optional[zmq.Context] = None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        ep = Endpoints(cfg.run_dir)
        self.inputs: Receiver = Receiver(self.ctx, ep.scheduler_inputs(cfg.replica), m.FrontendToScheduler)
        self.results: Receiver = Receiver(self.ctx, ep.worker_results(cfg.replica), m.WorkerToScheduler)
        self.to_workers = [Sender(self.ctx, ep.worker_inputs(cfg.replica, r), bind=True)
                           for r in range(cfg.tp_size)]
        self.to_frontend = Sender(self.ctx, ep.frontend_outputs())
        self.to_supervisor = Sender(self.ctx, ep.supervisor())
        self.trace = TraceWriter(cfg.record_trace) if cfg.record_trace else None
        self.scheduler: Optional[Scheduler] = None
        self.worker_pids: dict[int, int] = {}
        self.remote_ranks: set[int] = set()
        self.needs_workers = True  # at start, and after a worker failure until the new ones are ready
        self.state = "starting"
        self.draining = False
        self.restarts = 0
        self.forward_time = self.idle_time = self.busy_time = 0.0
        self.last_stats_sent = 0.0
        self.interval_log = IntervalLog(log, cfg.log_interval_s)

    # ------------------------------------------------------------------ workers

    def _record(self, direction: str, frame: bytes) -> None:
        if self.trace is not None:
            self.trace.append(direction, frame)

    def _broadcast(self, msg) -> bytes:
        data = encode(msg)
        for sender in self.to_workers:
            sender.send_bytes(data)
        self._record("to_worker", data)
        return data

    def _is_expected(self, msg, want: type, step: Optional[int]) -> bool:
        """Whether ``msg`` answers what we wait for; anything else (a stale result of a
        written-off step, a rank that does not exist, a stray peer) is logged and skipped."""
        if not isinstance(msg, want):
            log.warning("ignoring unexpected %s from a worker", type(msg).__name__)
            return False
        if not 0 <= msg.rank < self.cfg.tp_size:
            log.warning("ignoring %s from rank %d: the replica has %d rank(s)",
                        type(msg).__name__, msg.rank, self.cfg.tp_size)
            return False
        if step is not None and msg.step != step:
            log.warning("ignoring a result for step %d while waiting for step %d", msg.step, step)
            return False
        return True

    def _recv_from_workers(self, want: type, timeout_s: float,
                           step: Optional[int] = None) -> dict[int, object]:
        """One message of type ``want`` from every rank, watching worker liveness meanwhile."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        while len(got) < self.cfg.tp_size:
            msg = self.results.recv(timeout_ms=100)
            if msg is not None and self._is_expected(msg, want, step):
                if not isinstance(msg, m.WorkerHello):  # the trace header carries the hello
                    self._record("from_worker", self.results.last_frame)
                if isinstance(msg, m.StepResult) and msg.error:
                    raise WorkerFailure(f"worker rank {msg.rank} failed: {msg.error}")
                got[msg.rank] = msg
                if isinstance(msg, m.WorkerHello):
                    self.worker_pids[msg.rank] = msg.pid
                    if msg.hostname not in ("", socket.gethostname()):
                        # a pid on another node says nothing here: the step timeout watches it
                        self.remote_ranks.add(msg.rank)
                continue
            now = time.monotonic()
            if now >= next_check:  # at most every 100 ms, even while stray frames pour in
                next_check = now + 0.1
                self._check_worker_pids()
                self._send_stats()
            if now > deadline:
                missing = sorted(set(range(self.cfg.tp_size)) - set(got))
                raise WorkerFailure(
                    f"worker rank(s) {missing} sent no {want.__name__} within {timeout_s:.1f}s (hung?)")
        return got

    def _check_worker_pids(self) -> None:
        for rank, pid in self.worker_pids.items():
            if rank in self.remote_ranks:
                continue
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                status = psutil.STATUS_DEAD
            if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                raise WorkerFailure(f"worker rank {rank} (pid {pid}) died")

    def connect_workers(self) -> None:
        cfg = self.cfg
        hellos = self._recv_from_workers(m.WorkerHello, cfg.worker_start_timeout_s)
        block_bytes = max(h.block_bytes for h in hellos.values())
        fit = min(h.max_gpu_blocks for h in hellos.values())
        num_gpu_blocks = cfg.num_gpu_blocks or fit
        if num_gpu_blocks > fit:
            log.warning("--num-gpu-blocks %d exceeds the %d that fit; using %d", num_gpu_blocks, fit, fit)
            num_gpu_blocks = fit
        num_cpu_blocks = int(cfg.swap_space_gib * (1 << 30)) // block_bytes
        init = m.WorkerInit(
            replica=cfg.replica, tp_size=cfg.tp_size, block_size=cfg.block_size,
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, seed=cfg.seed, debug_invariants=cfg.debug_invariants,
        )
        if self.trace is not None:
            self.trace.write_header(hellos[0], init, self.cfg.trace_config())
        self._broadcast(init)
        self._recv_from_workers(m.WorkerReady, cfg.worker_start_timeout_s)
        self.needs_workers = False
        if self.scheduler is None or self.scheduler.config.num_gpu_blocks != num_gpu_blocks:
            # A recovered replica keeps its Scheduler (fail_all left it clean) so step
            # numbers keep increasing; only a different cache size needs a new one.
            self.scheduler = Scheduler(cfg.scheduler_config(num_gpu_blocks, num_cpu_blocks))
        self.state = "draining" if self.draining else "ready"
        log.info("replica %d ready: %d device blocks, %d host blocks of %d tokens",
                 cfg.replica, num_gpu_blocks, num_cpu_blocks, cfg.block_size)

    def _recover(self, reason: str) -> None:
        """Fail in-flight requests and ask the supervisor for fresh workers; the loop then
        reconnects them and rebuilds the cache from clean."""
        log.error("replica %d: %s; failing in-flight requests and restarting workers", self.cfg.replica, reason)
        self.state = "recovering"
        if self.scheduler is not None:
            why = f"replica {self.cfg.replica} lost its worker: {reason}"
            self._record("fail_all", why.encode())
            self._send_deltas(self.scheduler.fail_all(why))
        self.restarts += 1
        self.worker_pids.clear()
        self.remote_ranks.clear()
        self.results.recv_nowait()  # stale results from the old workers
        self.needs_workers = True
        self.to_supervisor.send(m.RestartWorkers(replica=self.cfg.replica, reason=reason))
        self._send_stats(force=True)

    # ------------------------------------------------------------------ frontend

    def _send_cache_events(self) -> None:
        """Prefix-cache changes for the router; always ahead of the deltas and stats they explain."""
        drained = self.scheduler.cache_events.drain() if self.scheduler is not None else None
        if drained is not None:
            seq, reset, stored, removed = drained
            self.to_frontend.send(m.PrefixCacheEvents(self.cfg.replica, os.getpid(), seq, reset, stored, removed))

    def _send_deltas(self, deltas) -> None:
        """``deltas``: a list of RequestDelta, or a step's StepOutputs (plain tokens as lists)."""
        self._send_cache_events()
        if deltas:
            step = self.scheduler.step if self.scheduler is not None else 0
            if isinstance(deltas, list):
                self.to_frontend.send(m.RequestOutputs(replica=self.cfg.replica, step=step, deltas=deltas))
            else:
                self.to_frontend.send(m.RequestOutputs(
                    replica=self.cfg.replica, step=step, deltas=deltas.deltas,
                    token_request_ids=deltas.token_request_ids, token_indices=deltas.token_indices,
                    token_ids=deltas.token_ids))

    def _handle_input(self, msg) -> None:
        if self.trace is not None:  # re-encoding costs a little; only pay it when recording
            self._record("from_frontend", encode(msg))
        deltas, self.draining = apply_frontend_message(self.scheduler, msg, self.draining)
        if self.draining:
            self.state = "draining"
        self._send_deltas(deltas)

    def _send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_stats_sent < self.cfg.stats_interval_s:
            return
        self.last_stats_sent = now
        self._send_cache_events()
        counts = self.scheduler.stats() if self.scheduler is not None else {}
        stats = m.SchedulerStats(
            replica=self.cfg.replica, state=self.state,
            step=self.scheduler.step if self.scheduler is not None else 0,
            busy_time_s=self.busy_time, worker_forward_time_s=self.forward_time,
            worker_idle_time_s=self.idle_time, worker_restarts=self.restarts,
            max_model_len=self.cfg.max_model_len, block_size=self.cfg.block_size,
            pid=os.getpid(), worker_pids=[self.worker_pids[r] for r in sorted(self.worker_pids)],
            **counts)
        self.to_frontend.send(stats)
        self.to_supervisor.send(m.Heartbeat(role="scheduler", replica=self.cfg.replica, pid=stats.pid))
        self.interval_log.maybe_log(stats)

    # ------------------------------------------------------------------ loop

    def step(self, back_to_back: bool = True) -> None:
        """One step; ``back_to_back`` when the previous step ran without waiting for input,
        so the worker's idle time since then is scheduling + IPC overhead, not an empty queue."""
        sched = self.scheduler
        t0 = time.perf_counter()
        out = sched.schedule()
        self._broadcast(out)
        results = self._recv_from_workers(m.StepResult, self.cfg.step_timeout_s, step=out.step)
        result = results[0]
        try:
            deltas = sched.update_from_output(out, result)
        except StepResultMismatch as exc:
            raise WorkerFailure(f"worker rank 0 sent a result that does not fit its step: {exc}") from None
        self._send_deltas(deltas)
        self.forward_time += result.forward_time_s
        if back_to_back:
            self.idle_time += result.idle_time_s
        self.busy_time += time.perf_counter() - t0

    def run(self) -> None:
        self.to_supervisor.send(m.ProcessReady(role="scheduler", replica=self.cfg.replica, rank=0, pid=os.getpid()))
        self._send_stats(force=True)
        while True:
            try:
                if self.needs_workers:
                    self.connect_workers()
                    self._send_stats(force=True)
                busy = self.scheduler.has_unfinished()
                for msg in self.inputs.recv_nowait() if busy else self._wait_input():
                    self._handle_input(msg)
                if self.scheduler.has_unfinished():
                    self.step(back_to_back=busy)
                elif not busy:
                    self._check_worker_pids()  # a worker that dies while idle is replaced at once
                    self._discard_stray_results()
                self._send_stats()
            except WorkerFailure as exc:
                self._recover(str(exc))

    def _discard_stray_results(self) -> None:
        """Nothing is expected from the workers while idle: read (and log) whatever came, so
        stray frames neither pile up in memory nor sit ahead of the next step's results."""
        for msg in self.results.recv_nowait():
            log.warning("ignoring %s from a worker while idle", type(msg).__name__)

    def _wait_input(self) -> list:
        msg = self.inputs.recv(timeout_ms=self.cfg.stats_interval_s * 1000)
        return [] if msg is None else [msg, *self.inputs.recv_nowait()]

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        for s in (self.inputs, self.results, self.to_frontend, self.to_supervisor, *self.to_workers):
            s.close()
