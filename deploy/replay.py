"""``pagedserve replay TRACE``: feed a recorded run to fresh workers and compare every step.

This process plays the scheduler: it starts the recorded number of workers, checks they
load the recorded model, sends the recorded frames byte for byte, and compares each step
result with the recorded one. Sampling is seeded per request and position, so the same
device kind must reproduce every token bit for bit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Optional

import zmq

from pagedserve.deploy.children import Child, free_tcp_port, spawn
from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder
from pagedserve.protocol.trace import Trace, TraceError, read_trace
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, make_run_dir


class ReplayMismatch(Exception):
    pass


def compare_results(step: int, recorded: m.StepResult, replayed: m.StepResult) -> Optional[str]:
    if replayed.error:
        return f"step {step}: the worker failed: {replayed.error}"
    if recorded.req_ids != replayed.req_ids:
        return f"step {step}: sampled requests differ: recorded {recorded.req_ids}, replayed {replayed.req_ids}"
    for i, (a, b) in enumerate(zip(recorded.sampled_token_ids, replayed.sampled_token_ids)):
        if a != b:
            return f"step {step}, request {recorded.req_ids[i]}: recorded token {a}, replayed token {b}"
    if (recorded.logprobs or []) != (replayed.logprobs or []):
        return f"step {step}: logprobs differ: recorded {recorded.logprobs}, replayed {replayed.logprobs}"
    return None


class WorkerReplay:
    def __init__(self, trace: Trace, model: str, device: str, timeout_s: float = 300.0):
        self.trace, self.model, self.device, self.timeout_s = trace, model, device, timeout_s
        self.cfg = trace.meta["config"]
        self.tp = int(self.cfg.get("tp_size", 1))
        self.ctx = zmq.Context()
        self.run_dir = str(make_run_dir())
        ep = Endpoints(self.run_dir)
        self.results: Receiver = Receiver(self.ctx, ep.worker_results(0), m.WorkerToScheduler)
        self.senders = [Sender(self.ctx, ep.worker_inputs(0, r), bind=True) for r in range(self.tp)]
        self.workers: list[Child] = []
        self.recorded_hello = Decoder(m.WorkerToScheduler).decode(trace.hello_frame)

    def _start_workers(self) -> None:
        for w in self.workers:
            w.kill()
        dist = f"tcp://127.0.0.1:{free_tcp_port()}" if self.tp > 1 else None
        self.workers = []
        for rank in range(self.tp):
            cmd = [sys.executable, "-m", "pagedserve.worker_proc", "--run-dir", self.run_dir, "--model", self.model,
                   "--rank", str(rank), "--tp-size", str(self.tp), "--device", self.device,
                   "--block-size", str(self.cfg.get("block_size", 16)), "--log-level", "WARNING"]
            self.workers.append(spawn("worker", 0, rank, cmd + (["--dist-init", dist] if dist else [])))
        hellos = self._collect(m.WorkerHello)
        if hellos[0].model_id != self.recorded_hello.model_id:
            raise TraceError(f"the trace was recorded with model {self.recorded_hello.model_id}, "
                             f"but {self.model} is {hellos[0].model_id}")

    def _collect(self, kind: type) -> dict[int, object]:
        got: dict[int, object] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < self.tp:
            for w in self.workers:
                if w.popen.poll() is not None:
                    raise ReplayMismatch(f"worker {w.rank} exited with code {w.popen.returncode}")
            if time.monotonic() > deadline:
                raise ReplayMismatch(f"no {kind.__name__} from the workers within {self.timeout_s:.0f}s")
            msg = self.results.recv(timeout_ms=200)
            if isinstance(msg, kind):
                got[msg.rank] = msg
        return got

    def run(self) -> tuple[int, int]:
        """Replays every step; returns (steps, sampled tokens) or raises ReplayMismatch."""
        to_worker, from_worker = Decoder(m.SchedulerToWorker), Decoder(m.WorkerToScheduler)
        self._start_workers()
        steps = tokens = 0
        pending: Optional[tuple[int, m.StepResult]] = None  # replayed result awaiting its record
        for direction, payload in self.trace.records:
            if direction == "fail_all":
                self._start_workers()
            elif direction == "to_worker":
                msg = to_worker.decode(payload)
                for s in self.senders:
                    s.send_bytes(payload)
                if isinstance(msg, m.WorkerInit):
                    self._collect(m.WorkerReady)
                elif isinstance(msg, m.SchedulerOutput):
                    pending = (msg.step, self._collect(m.StepResult)[0])
                    steps += 1
            elif direction == "from_worker":
                rec = from_worker.decode(payload)
                if isinstance(rec, m.StepResult) and rec.rank == 0 and pending is not None:
                    step, replayed = pending
                    pending = None
                    if rec.error:
                        continue  # the recorded worker failed here; fail_all follows
                    diff = compare_results(step, rec, replayed)
                    if diff:
                        raise ReplayMismatch(diff)
                    tokens += len(rec.sampled_token_ids)
        return steps, tokens

    def close(self) -> None:
        for w in self.workers:
            w.terminate()
        for w in self.workers:
            w.wait_or_kill(5)
        self.ctx.destroy(linger=0)
        import shutil

        shutil.rmtree(self.run_dir, ignore_errors=True)


def replay_main(ns: argparse.Namespace) -> int:
    if ns.scheduler_only:
        return subprocess.call([sys.executable, "-m", "pagedserve.scheduler_proc.replay", ns.trace])
    try:
        trace = read_trace(ns.trace)
    except TraceError as exc:
        print(f"pagedserve replay: {exc}", file=sys.stderr)
        return 2
    if trace.torn_tail:
        print(f"pagedserve replay: warning: {trace.torn_tail}; replaying the records before it", file=sys.stderr)
    model = ns.model or trace.meta["config"].get("model")
    if not model:
        print("pagedserve replay: the trace names no model directory; pass --model DIR", file=sys.stderr)
        return 2
    rep = WorkerReplay(trace, model, ns.device)
    try:
        steps, tokens = rep.run()
    except TraceError as exc:
        print(f"pagedserve replay: {exc}", file=sys.stderr)
        return 2
    except ReplayMismatch as exc:
        print(f"pagedserve replay: DIFFERS at {exc}", file=sys.stderr)
        return 1
    finally:
        rep.close()
    print(f"pagedserve replay: {steps} steps, {tokens} sampled tokens, identical to the recording")
    return 0
