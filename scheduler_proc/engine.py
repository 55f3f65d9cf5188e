"""The scheduler process's loop: the only code here that touches sockets.

Each turn: take what the frontend sent, ask the Scheduler for one step, send the same
encoded bytes to every worker, wait for their results, hand the sampled tokens back to
the Scheduler and the resulting deltas to the frontend. With async scheduling (the default)
the next step is scheduled and sent before the current one's result is awaited, whenever
the Scheduler allows it (``can_schedule_ahead``), so the workers find it queued when they
finish and the scheduler's work hides behind the device's. Workers that die or stop making
progress end every in-flight request with an explicit error and are replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import deque
from typing import Optional

import psutil
import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.trace import TraceWriter
from pagedserve.protocol.validate import RequestFrameDecoder, rejection_delta
from pagedserve.protocol.worker_link import PeerUnreachable, WorkerRouter
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender
from pagedserve.scheduler_proc.engine_config import EngineConfig
from pagedserve.scheduler_proc.frontend_inputs import apply_frontend_message
from pagedserve.scheduler_proc.grammar_cache import GrammarBackendLoader, grammar_cache_for
from pagedserve.scheduler_proc.grammar_gate import GrammarGate
from pagedserve.scheduler_proc.interval_log import IntervalLog
from pagedserve.scheduler_proc.output_processor import StepResultMismatch
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.scheduler_proc.sliding_window import hybrid_groups, window_to_free
from pagedserve.scheduler_proc.step_timeout import StepTimeout

log = logging.getLogger("pagedserve.scheduler")


class WorkerFailure(RuntimeError):
    """A worker died, hung past the step timeout, or reported an error."""


class EngineLoop:
    def __init__(self, cfg: EngineConfig, ctx: Optional[zmq.Context] = None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        ep = Endpoints(cfg.run_dir)
        self.inputs: Receiver = Receiver(self.ctx, ep.scheduler_inputs(cfg.replica), m.FrontendToScheduler)
        self.input_decoder = RequestFrameDecoder(max_frame_bytes=self.inputs.decoder.max_frame_bytes)
        self.inputs.decoder = self.input_decoder  # answers the requests of frames it rejects
        # One ROUTER: steps out to exactly this replica's workers, their results in (worker_link.py).
        self.results = WorkerRouter(self.ctx, ep, cfg.replica, cfg.tensor_parallel_size)
        self.to_frontend = Sender(self.ctx, ep.frontend_outputs())
        self.to_supervisor = Sender(self.ctx, ep.supervisor())
        self.trace = TraceWriter(cfg.record_trace) if cfg.record_trace else None
        self.scheduler: Optional[Scheduler] = None
        self.pending: deque[m.SchedulerOutput] = deque()  # steps sent whose results are not in
        self.sent_at: dict[int, float] = {}  # step -> when it was sent (the step timeout learns from it)
        # (step, rank) -> (result, frame) of a later in-flight step that came in first: each rank's
        # results come in step order, but two ranks' need not (one rank's frame can wait in its
        # socket while another finishes the next step), and dropping it would hang that step.
        self.early: dict[tuple[int, int], tuple[m.StepResult, bytes]] = {}
        self.last_result_at = 0.0
        self.worker_pids: dict[int, int] = {}
        self.remote_ranks: set[int] = set()
        self.needs_workers = True  # at start, and after a worker failure until the new ones are ready
        self.state = "starting"
        self.draining = False
        self.restarts = 0
        self.forward_time = self.idle_time = 0.0
        self.last_stats_sent = 0.0
        self.interval_log = IntervalLog(log, cfg.log_interval_s)
        self.step_timeout = StepTimeout(cfg.step_timeout_s)
        # Structured output: xgrammar and the tokenizer load in a thread while the workers start.
        self.grammar_loader = GrammarBackendLoader(cfg.model) if cfg.model else None
        if self.grammar_loader is not None:
            self.grammar_loader.start()
        self.grammar_gate = GrammarGate(self.grammar_loader)

    # ------------------------------------------------------------------ workers

    def _record(self, direction: str, frame: bytes) -> None:
        if self.trace is not None:
            self.trace.append(direction, frame)

    def _broadcast(self, msg) -> bytes:
        data = encode(msg)
        # Recorded before it is sent: a step that reached no worker (one died while the loop was
        # idle) still took its step number, and a replay must schedule it too.
        self._record("to_worker", data)
        try:
            self.results.broadcast(data)
        except PeerUnreachable as exc:
            raise WorkerFailure(str(exc)) from None
        return data

    def _send_next_step(self) -> None:
        """Schedule a step and send it; then the ends the step's clock decided (time limits)."""
        out = self.scheduler.schedule()
        lora_step = self.scheduler.take_lora_step()
        if lora_step is not None:  # its adapter changes, applied before its forward (recorded, replayed)
            self._broadcast(lora_step)
        self.pending.append(out)
        self._broadcast(out)
        self.sent_at[out.step] = time.perf_counter()
        self._send_deltas(self.scheduler.take_timed_out())

    def _is_expected(self, msg, want: type, step: Optional[int]) -> bool:
        """Whether ``msg`` answers what we wait for; anything else (a stale result of a
        written-off step, a rank that does not exist, a stray peer) is logged and skipped."""
        if not isinstance(msg, want):
            log.warning("ignoring unexpected %s from a worker", type(msg).__name__)
            return False
        if not 0 <= msg.rank < self.cfg.tensor_parallel_size:
            log.warning("ignoring %s from rank %d: the replica has %d rank(s)",
                        type(msg).__name__, msg.rank, self.cfg.tensor_parallel_size)
            return False
        if step is not None and msg.step != step:
            log.warning("ignoring a result for step %d while waiting for step %d", msg.step, step)
            return False
        return True

    def _is_early(self, msg, step: Optional[int]) -> bool:
        """A result of a step sent after the awaited one (kept until that step is awaited)."""
        return (step is not None and isinstance(msg, m.StepResult) and msg.step > step
                and 0 <= msg.rank < self.cfg.tensor_parallel_size and any(o.step == msg.step for o in self.pending))

    def _take_early(self, step: Optional[int]) -> Optional[tuple[m.StepResult, bytes]]:
        ranks = range(self.cfg.tensor_parallel_size) if step is not None else ()
        return next((self.early.pop((step, rank)) for rank in ranks if (step, rank) in self.early), None)

    def _recv_from_workers(self, want: type, timeout_s: float,
                           step: Optional[int] = None) -> dict[int, object]:
        """One message of type ``want`` from every rank, watching worker liveness meanwhile."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        while len(got) < self.cfg.tensor_parallel_size:
            msg, frame = self._take_early(step) or (self.results.recv(timeout_ms=100), None)
            if msg is not None and self._is_early(msg, step):
                self.early[(msg.step, msg.rank)] = (msg, self.results.last_frame)
                continue
            if msg is not None and self._is_expected(msg, want, step):
                if not isinstance(msg, m.WorkerHello):  # the trace header carries the hello
                    self._record("from_worker", frame if frame is not None else self.results.last_frame)
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
                missing = sorted(set(range(self.cfg.tensor_parallel_size)) - set(got))
                self._ask_for_stacks(missing)
                raise WorkerFailure(
                    f"worker rank(s) {missing} sent no {want.__name__} within {timeout_s:.1f}s (hung?)")
        return got

    def _ask_for_stacks(self, ranks: list[int]) -> None:
        """A late rank on this host prints its threads' stacks (the worker's SIGUSR1 handler)."""
        for rank in ranks:
            pid = self.worker_pids.get(rank)
            if pid is None or rank in self.remote_ranks:
                continue
            try:
                os.kill(pid, signal.SIGUSR1)
                log.error("worker rank %d (pid %d) is late: its stacks follow in its log", rank, pid)
            except OSError:
                pass

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
        num_cpu_blocks = int(cfg.swap_space * (1 << 30)) // block_bytes
        init = m.WorkerInit(block_size=cfg.block_size, num_gpu_blocks=num_gpu_blocks,
                            num_cpu_blocks=num_cpu_blocks, max_model_len=cfg.max_model_len, seed=cfg.seed)
        if self.trace is not None:
            self.trace.write_header(hellos[0], init, self.cfg.trace_config())
        self._broadcast(init)
        self._recv_from_workers(m.WorkerReady, cfg.worker_start_timeout_s)
        self.needs_workers = False
        self.step_timeout.restart()  # fresh workers warm up again
        vocab_size = min(h.vocab_size for h in hellos.values())
        hello = hellos[0]
        window, note = window_to_free(hello.layer_windows, cfg.speculative_method() == "draft_model", hello.hybrid_kv)
        if note and self.scheduler is None:
            log.info("%s", note)
        config = cfg.scheduler_config(num_gpu_blocks, num_cpu_blocks, vocab_size, window,
                                      hybrid_groups(hello.layer_windows, hello.hybrid_kv))
        if self.scheduler is None or self.scheduler.config != config:
            # A recovered replica keeps its Scheduler (fail_all left it clean) so step
            # numbers keep increasing; only a different cache or model needs a new one, which
            # takes over the registered LoRA adapters (and re-sends them to the new workers).
            old = self.scheduler.lora_adapters() if self.scheduler is not None else ()
            self.scheduler = Scheduler(config, grammar_cache_for(self.grammar_loader, vocab_size), lora_adapters=old)
            self.grammar_gate.cache = self.scheduler.grammars
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
        self.pending.clear()  # written off: fail_all ended their requests
        self.early.clear()
        self.sent_at.clear()
        self.results.forget_peers()  # the old workers' answers are dropped from now on
        self.results.recv_nowait()
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

    def _send_deltas(self, deltas, step: Optional[int] = None) -> None:
        """``deltas``: a list of RequestDelta, or a step's StepOutputs (plain tokens as lists)."""
        self._send_cache_events()
        if deltas:
            if step is None:
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

    def _answer_rejected_requests(self) -> None:
        """An AddRequest frame that failed to decode ends its request with an error, so its
        caller never waits for an answer; an id already in flight here is left alone (the
        error would end that other request)."""
        deltas = [rejection_delta(request_id, reason)
                  for request_id, reason in self.input_decoder.take_rejected()
                  if self.scheduler is None or request_id not in self.scheduler.requests]
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
            worker_forward_time_s=self.forward_time,
            worker_idle_time_s=self.idle_time, worker_restarts=self.restarts,
            max_model_len=self.cfg.max_model_len, block_size=self.cfg.block_size,
            pid=os.getpid(),
            **counts)
        self.to_frontend.send(stats)
        self.to_supervisor.try_send(m.Heartbeat(role="scheduler", replica=self.cfg.replica, pid=stats.pid))
        self.interval_log.maybe_log(stats)

    # ------------------------------------------------------------------ loop

    def step(self, back_to_back: bool = True) -> None:
        """One step; ``back_to_back`` when the previous step ran without waiting for input,
        so the worker's idle time since then is scheduling + IPC overhead, not an empty queue."""
        sched = self.scheduler
        pending = self.pending
        if not pending:
            self._send_next_step()
        if (self.cfg.async_scheduling and len(pending) == 1 and sched.has_unfinished()
                and sched.can_schedule_ahead()):
            self._send_next_step()  # runs right after the step out: no wait in between
        out = pending[0]
        timeout_s = self.step_timeout.for_step(out.total_num_scheduled_tokens)
        results = self._recv_from_workers(m.StepResult, timeout_s, step=out.step)
        pending.popleft()
        # The worker began this step when it was sent or when it finished the one before.
        now = time.perf_counter()
        began = max(self.sent_at.pop(out.step, now), self.last_result_at)
        self.last_result_at = now
        self.step_timeout.observe(now - began, out.total_num_scheduled_tokens)
        result = results[0]
        try:
            deltas = sched.update_from_output(out, result)
        except StepResultMismatch as exc:
            raise WorkerFailure(f"worker rank 0 sent a result that does not fit its step: {exc}") from None
        if self.cfg.async_scheduling and not pending and sched.has_unfinished():
            # Nothing is queued at the workers (this step could not be followed ahead): the
            # next step goes out before the deltas, whose encoding and send the workers would
            # otherwise wait through. Inputs that came meanwhile join the step after, as they
            # do whenever a step is scheduled ahead. The running set copies the lists these
            # deltas share with it before changing them (running.py).
            self._send_next_step()
        self._send_deltas(deltas, out.step)
        self.forward_time += result.forward_time_s
        if back_to_back:
            self.idle_time += result.idle_time_s

    def run(self) -> None:
        self.to_supervisor.send(m.ProcessReady(role="scheduler", replica=self.cfg.replica, rank=0, pid=os.getpid()))
        self._send_stats(force=True)
        while True:
            try:
                if self.needs_workers:
                    self.connect_workers()
                    self._send_stats(force=True)
                busy = self.scheduler.has_unfinished() or bool(self.pending)
                for msg in self.grammar_gate.admit(self.inputs.recv_nowait() if busy else self._wait_input()):
                    self._handle_input(msg)
                self._answer_rejected_requests()
                # Adapter changes with nothing to compute go out in an empty step: the workers read a
                # registered adapter ahead of its first request, and drop an unloaded one.
                if self.scheduler.has_unfinished() or self.pending or self.scheduler.has_lora_changes():
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
        for s in (self.inputs, self.results, self.to_frontend, self.to_supervisor):
            s.close()
