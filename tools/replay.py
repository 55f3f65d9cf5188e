"""``pagedserve replay TRACE``: feed a recorded run to fresh workers and compare every step.

This process plays the scheduler: it checks the model directory holds the recorded
weights, starts the recorded number of workers, sends them the recorded frames byte for
byte, and compares each step result with the recorded one. Sampling is seeded per request
and position, so the same device kind must reproduce every token bit for bit (pooled hidden
states, float sums, within float32 rounding: `pooled_difference`).
``--scheduler-only`` instead replays the frontend messages into a scheduler alone
(``pagedserve.scheduler_proc.replay``, in its own process: deploy never imports it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import zmq

from pagedserve.deploy.children import Child
from pagedserve.deploy.entry_points import python_module
from pagedserve.deploy.launcher import StartupError, spawn_workers, stop_children, wait_for
from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder, ProtocolError
from pagedserve.protocol.trace import Trace, TraceError, read_trace, weights_fingerprint
from pagedserve.protocol.worker_link import WorkerRouter
from pagedserve.protocol.zmq_io import Endpoints, make_run_dir


class ReplayMismatch(Exception):
    """The replayed workers did something other than what was recorded (message: where)."""


def compare_results(step: int, recorded: m.StepResult, replayed: m.StepResult) -> Optional[str]:
    """Where the replayed result first differs from the recorded one, or None."""
    if replayed.error:
        return f"step {step}: the worker failed: {replayed.error}"
    if replayed.step != recorded.step:
        return f"step {step}: the worker answered for step {replayed.step}"
    for i, (a, b) in enumerate(zip(recorded.req_ids, replayed.req_ids)):
        if a != b:
            return f"step {step}: sampled request #{i} differs: recorded {a}, replayed {b}"
    if len(recorded.req_ids) != len(replayed.req_ids):
        return (f"step {step}: recorded {len(recorded.req_ids)} sampled requests, "
                f"replayed {len(replayed.req_ids)}")
    for i, (a, b) in enumerate(zip(recorded.sampled_token_ids, replayed.sampled_token_ids)):
        if a != b:
            return f"step {step}, request {recorded.req_ids[i]}: recorded token {a}, replayed token {b}"
    if recorded.num_accepted_tokens != replayed.num_accepted_tokens:
        return (f"step {step}: recorded accepted proposals {recorded.num_accepted_tokens}, "
                f"replayed {replayed.num_accepted_tokens}")
    if (recorded.draft_token_ids or {}) != (replayed.draft_token_ids or {}):
        return (f"step {step}: recorded draft proposals {recorded.draft_token_ids}, "
                f"replayed {replayed.draft_token_ids}")
    rec_lp, rep_lp = recorded.logprobs or [], replayed.logprobs or []
    for i, (a, b) in enumerate(zip(rec_lp, rep_lp)):
        if a != b:
            return f"step {step}, request {recorded.req_ids[i]}: recorded logprob {a!r}, replayed {b!r}"
    if len(rec_lp) != len(rep_lp):
        return f"step {step}: recorded {len(rec_lp)} logprobs, replayed {len(rep_lp)}"
    rec_pooled, rep_pooled = recorded.pooled or {}, replayed.pooled or {}
    for req_id in sorted(set(rec_pooled) | set(rep_pooled)):
        differs = pooled_difference(rec_pooled.get(req_id), rep_pooled.get(req_id))
        if differs:
            return f"step {step}, request {req_id}: the pooled hidden states differ from the recorded ones: {differs}"
    return None


# A pooled chunk is a float32 sum of hidden states, not a sampled choice: its last bits follow the
# CPU's vector width (AVX2 and AVX-512 kernels add in another order), as transformers' own would.
# A golden recorded on one ISA replays on another within float32 rounding; anything past that is a
# real difference (another position, weight or norm moves it by far more).
POOLED_RTOL, POOLED_ATOL = 1e-4, 1e-5


def pooled_difference(recorded: Optional[m.PooledChunk], replayed: Optional[m.PooledChunk]) -> Optional[str]:
    """Why a replayed pooled chunk is not the recorded one, or None (same span, values within rounding)."""
    if recorded == replayed:
        return None
    if recorded is None or replayed is None:
        return "recorded " + ("none" if recorded is None else "a chunk") + ", replayed " + (
            "none" if replayed is None else "a chunk")
    if (recorded.start, recorded.count) != (replayed.start, replayed.count):
        return f"recorded positions {recorded.start}+{recorded.count}, replayed {replayed.start}+{replayed.count}"
    a, b = np.frombuffer(recorded.values, "<f4"), np.frombuffer(replayed.values, "<f4")
    if a.shape != b.shape:
        return f"recorded {a.size} values, replayed {b.size}"
    if not np.allclose(a, b, rtol=POOLED_RTOL, atol=POOLED_ATOL):
        return f"largest difference {float(np.max(np.abs(a - b))):.3g} (rounding allows {POOLED_RTOL:g} relative)"
    return None


def check_model(trace: Trace, model: str) -> None:
    """Refuses a model directory that is not the recorded one, before any worker starts."""
    if not (Path(model) / "config.json").is_file():
        raise TraceError(f"{model} is not a model directory (no config.json); pass --model DIR "
                         f"with the model the trace was recorded with ({trace.meta.get('model_id')})")
    recorded = trace.meta.get("weights")
    found = weights_fingerprint(model)
    if recorded and found != recorded:
        raise TraceError(f"the trace was recorded with model {trace.meta.get('model_id')} weights {recorded}, "
                         f"but {model} holds weights {found}: another model (or another seed) cannot "
                         "reproduce the recorded tokens")


class WorkerReplay:
    def __init__(self, trace: Trace, model: str, device: str, timeout_s: float = 300.0,
                 worker_args: tuple[str, ...] = ()):
        self.trace, self.model, self.device, self.timeout_s = trace, model, device, timeout_s
        self.worker_args = list(worker_args)
        self.cfg = trace.meta["config"]
        self.tp = int(self.cfg.get("tensor_parallel_size", self.cfg.get("tp_size", 1)))  # tp_size: older traces
        try:  # before the run dir and sockets exist: a bad header leaves nothing behind
            self.recorded_hello = Decoder(m.WorkerToScheduler).decode(trace.hello_frame)
        except ProtocolError as exc:
            raise TraceError(f"{trace.path}: the recorded WorkerHello is not a valid frame: {exc}") from None
        self.ctx = zmq.Context()
        self.run_dir = str(make_run_dir())
        ep = Endpoints(self.run_dir)
        self.results = WorkerRouter(self.ctx, ep, 0, self.tp)  # stands in for the scheduler
        self.workers: list[Child] = []

    def _start_workers(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = spawn_workers(0, self.tp, self._worker_cmd)
        try:
            hellos = self._collect(m.WorkerHello)
        except ReplayMismatch as exc:  # nothing was replayed yet: the trace cannot be used here
            raise TraceError(f"the replay's workers did not start on {self.device}: {exc}") from None
        if hellos[0].model_id != self.recorded_hello.model_id:
            raise TraceError(f"the trace was recorded with model {self.recorded_hello.model_id}, "
                             f"but {self.model} is {hellos[0].model_id}")

    def _worker_cmd(self, rank: int, dist_init: Optional[str]) -> list[str]:
        """The recorded workers' way of computing: their dtype, CUDA graphs or not, the draft model."""
        hello, recorded = self.recorded_hello, []
        if hello.dtype:
            recorded += ["--dtype", hello.dtype]
        if hello.enforce_eager:
            recorded.append("--enforce-eager")
        if self.cfg.get("speculative_config"):
            recorded += ["--speculative-config", self.cfg["speculative_config"]]
        if self.cfg.get("enable_lora"):  # the adapters themselves come in the trace's LoRAStep frames
            recorded += ["--enable-lora", "--max-loras", str(self.cfg.get("max_loras", 4))]
        return python_module("pagedserve.worker_proc", "--run-dir", self.run_dir, "--model", self.model,
                             "--rank", str(rank), "--tensor-parallel-size", str(self.tp), "--device", self.device,
                             "--block-size", str(self.cfg.get("block_size", 16)), "--log-level", "WARNING",
                             *recorded, *self.worker_args, *(["--dist-init", dist_init] if dist_init else []))

    def _collect(self, kind: type) -> dict[int, object]:
        """One ``kind`` message from each rank."""
        got: dict[int, object] = {}
        pending = set(range(self.tp))

        def accept(msg) -> None:
            if isinstance(msg, kind):
                got[msg.rank] = msg
                pending.discard(msg.rank)

        try:
            wait_for(pending, self.results.recv, lambda: self.workers,
                     self.timeout_s, accept, what=kind.__name__)
        except StartupError as exc:
            raise ReplayMismatch(str(exc)) from None
        return got

    def run(self) -> tuple[int, int]:
        """Replays every step; returns (steps, sampled tokens) or raises ReplayMismatch."""
        to_worker, from_worker = Decoder(m.SchedulerToWorker), Decoder(m.WorkerToScheduler)
        self._start_workers()
        steps = tokens = 0
        # Replayed results awaiting their record, by step: with async scheduling the next step's
        # frame comes before this step's result in the trace.
        pending: dict[int, m.StepResult] = {}
        for index, (direction, payload) in enumerate(self.trace.records):
            try:
                if direction == "fail_all":
                    pending.clear()
                    self._start_workers()
                elif direction == "to_worker":
                    msg = to_worker.decode(payload)
                    self.results.broadcast(payload)
                    if isinstance(msg, m.WorkerInit):
                        self._collect(m.WorkerReady)
                    elif isinstance(msg, m.SchedulerOutput):
                        pending[msg.step] = self._collect(m.StepResult)[0]
                        steps += 1
                elif direction == "from_worker":
                    rec = from_worker.decode(payload)
                    if isinstance(rec, m.StepResult) and rec.rank == 0 and rec.step in pending:
                        step, replayed = rec.step, pending.pop(rec.step)
                        if rec.error:
                            continue  # the recorded worker failed here; fail_all follows
                        diff = compare_results(step, rec, replayed)
                        if diff:
                            raise ReplayMismatch(diff)
                        tokens += len(rec.sampled_token_ids)
            except ProtocolError as exc:
                raise TraceError(f"{self.trace.path}: record {index + 2} ({direction}) "
                                 f"is not a valid frame: {exc}") from None
        return steps, tokens

    def close(self) -> None:
        stop_children(self.workers)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def replay_workers(trace_path: str, model: Optional[str], device: Optional[str], num_threads: Optional[int] = None,
                   worker_args: tuple[str, ...] = ()) -> tuple[int, int]:
    """Returns (steps, tokens); raises TraceError (unusable) or ReplayMismatch (differs)."""
    trace = read_trace(trace_path)
    if trace.torn_tail:
        print(f"pagedserve replay: warning: {trace.torn_tail}; replaying the records before it", file=sys.stderr)
    model = model or trace.meta["config"].get("model")
    if not model:
        raise TraceError("the trace names no model directory; pass --model DIR")
    check_model(trace, model)
    recorded_kind = str(trace.meta.get("device", "cpu")).split(":")[0]
    device = device or recorded_kind  # replaying where it was recorded is what reproduces it
    if recorded_kind != device.split(":")[0]:
        print(f"pagedserve replay: warning: recorded on {trace.meta.get('device')}, replaying on {device}; "
              "tokens are only guaranteed identical on the same device kind", file=sys.stderr)
    args = tuple(worker_args) + (("--num-threads", str(num_threads)) if num_threads else ())
    rep = WorkerReplay(trace, model, device, worker_args=args)
    try:
        return rep.run()
    finally:
        rep.close()


def replay_main(ns: argparse.Namespace) -> int:
    if ns.scheduler_only:
        model = ["--model", ns.model] if ns.model else []  # constrained requests' masks need its tokenizer
        return subprocess.call(python_module("pagedserve.scheduler_proc.replay", ns.trace, *model))
    try:
        steps, tokens = replay_workers(ns.trace, ns.model, ns.device, getattr(ns, "num_threads", None))
    except TraceError as exc:
        print(f"pagedserve replay: {exc}", file=sys.stderr)
        return 2
    except ReplayMismatch as exc:
        print(f"pagedserve replay: DIFFERS at {exc}", file=sys.stderr)
        return 1
    print(f"pagedserve replay: {steps} steps, {tokens} sampled tokens, identical to the recording")
    return 0
