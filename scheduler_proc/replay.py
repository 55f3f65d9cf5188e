"""Replays a trace's frontend messages and step results into a fresh Scheduler.

The scheduler is deterministic given its arrivals and step results, so every
SchedulerOutput it builds must equal the recorded one byte for byte, and so must the LoRAStep
recorded just before it (a step without one must have none here either). A step recorded before
the previous step's result (async scheduling) is scheduled at the same point here, so the
replayed scheduler decides ahead exactly where the recorded one did. Run as
``python -m pagedserve.scheduler_proc.replay TRACE`` (``pagedserve replay --scheduler-only``).
"""

from __future__ import annotations

if __name__ == "__main__":  # before anything imports transformers (pagedserve/clean_path.py)
    from pagedserve.clean_path import drop_working_directory

    drop_working_directory()

import os
import sys
from collections import deque
from dataclasses import dataclass, fields
from typing import Optional

import msgspec

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import Decoder, ProtocolError, encode
from pagedserve.protocol.trace import TraceError, read_trace
from pagedserve.scheduler_proc.engine_config import EngineConfig
from pagedserve.scheduler_proc.frontend_inputs import apply_frontend_message
from pagedserve.scheduler_proc.grammar_cache import GrammarBackendLoader, grammar_cache_for
from pagedserve.scheduler_proc.output_processor import StepResultMismatch
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.scheduler_proc.sliding_window import hybrid_groups, window_to_free


@dataclass
class SchedulerReplayReport:
    steps: int
    mismatch: Optional[str] = None
    torn_tail: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def first_difference(recorded, replayed, path: str = "") -> str:
    """A human-readable path to the first field where two decoded messages differ."""
    if isinstance(recorded, msgspec.Struct) and type(recorded) is type(replayed):
        for name in recorded.__struct_fields__:
            a, b = getattr(recorded, name), getattr(replayed, name)
            if a != b:
                return first_difference(a, b, f"{path}.{name}" if path else name)
    if isinstance(recorded, list) and isinstance(replayed, list):
        for i, (a, b) in enumerate(zip(recorded, replayed)):
            if a != b:
                return first_difference(a, b, f"{path}[{i}]")
        if len(recorded) != len(replayed):
            return f"{path}: recorded {len(recorded)} items, replayed {len(replayed)}"
    return f"{path}: recorded {recorded!r}, replayed {replayed!r}"


# Traces recorded before the scheduler took serve's option names (runtime/options.py).
_RENAMED_CONFIG_KEYS = {"tp_size": "tensor_parallel_size", "swap_space_gib": "swap_space"}


def _engine_config(trace) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    recorded = {_RENAMED_CONFIG_KEYS.get(k, k): v for k, v in trace.meta["config"].items()}
    try:
        return EngineConfig(run_dir="", **{k: v for k, v in recorded.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{trace.path}: the recorded scheduler config is unusable: {exc}") from None


def replay_scheduler(trace_path: str, model: Optional[str] = None) -> SchedulerReplayReport:
    """Rebuilds every SchedulerOutput from the recorded inputs; raises TraceError if unusable.
    ``model``: the model directory, in place of the recorded path (grammar-constrained requests
    need its tokenizer to rebuild their masks)."""
    trace = read_trace(trace_path)
    cfg = _engine_config(trace)
    loader = None  # loads at the first constrained request, in the replaying thread
    if model and not os.path.isdir(model):
        raise TraceError(f"--model {model}: not a model directory")
    model = model or cfg.model
    to_worker, from_worker = Decoder(m.SchedulerToWorker), Decoder(m.WorkerToScheduler)
    from_frontend = Decoder(m.FrontendToScheduler)
    try:
        hello = from_worker.decode(trace.hello_frame)
        vocab_size = hello.vocab_size  # grammar masks' width
        window, _ = window_to_free(hello.layer_windows, cfg.speculative_method() == "draft_model", hello.hybrid_kv)
        groups = hybrid_groups(hello.layer_windows, hello.hybrid_kv)
    except ProtocolError as exc:
        raise TraceError(f"{trace_path}: the header's hello is not a valid frame: {exc}") from None
    sched: Optional[Scheduler] = None
    outs: deque[m.SchedulerOutput] = deque()  # replayed steps whose results are not yet applied
    lora_step: Optional[tuple[m.LoRAStep, bytes]] = None  # recorded ahead of the next SchedulerOutput
    draining = False
    steps = 0
    for index, (direction, payload) in enumerate(trace.records):
        where = f"record {index + 2} ({direction})"
        try:
            if direction == "to_worker":
                msg = to_worker.decode(payload)
                if isinstance(msg, m.WorkerInit) and (sched is None or
                                                      sched.config.num_gpu_blocks != msg.num_gpu_blocks):
                    if model and loader is None and os.path.isdir(model):
                        loader = GrammarBackendLoader(model)
                    sched = Scheduler(cfg.scheduler_config(msg.num_gpu_blocks, msg.num_cpu_blocks, sliding_window=window,
                                                           groups=groups),
                                      grammar_cache_for(loader, vocab_size),
                                      lora_adapters=sched.lora_adapters() if sched is not None else ())
                elif isinstance(msg, m.LoRAStep):
                    lora_step = (msg, payload)
                elif isinstance(msg, m.SchedulerOutput):
                    _require(sched, trace_path, where)
                    out = sched.schedule(msg.now_s)  # the recorded clock: time limits decide alike
                    outs.append(out)
                    steps += 1
                    if encode(out) != payload:
                        return SchedulerReplayReport(steps, f"step {msg.step} ({where}): "
                                                     + first_difference(msg, out))
                    mismatch = _lora_difference(lora_step, sched.take_lora_step(), msg.step)
                    lora_step = None
                    if mismatch:
                        return SchedulerReplayReport(steps, mismatch)
            elif direction == "from_frontend":
                _require(sched, trace_path, where)
                msg = from_frontend.decode(payload)
                if isinstance(msg, m.AddRequest) and msg.sampling.structured_outputs is not None and loader is None:
                    # refused for want of a tokenizer, it would show as a difference, not as the cause
                    raise TraceError(f"{where}: a grammar-constrained request needs the model's tokenizer, and "
                                     f"{model} is not a model directory here; pass --model DIR")
                _, draining = apply_frontend_message(sched, msg, draining)
            elif direction == "from_worker":
                msg = from_worker.decode(payload)
                if isinstance(msg, m.StepResult) and msg.rank == 0 and not msg.error:
                    while outs and outs[0].step < msg.step:
                        outs.popleft()
                    if outs and outs[0].step == msg.step:
                        try:
                            sched.update_from_output(outs.popleft(), msg)
                        except StepResultMismatch:
                            pass  # the engine failed its workers here too: the fail_all record follows
            elif direction == "fail_all":
                _require(sched, trace_path, where)
                sched.fail_all(payload.decode(errors="replace"))
                outs.clear()
        except ProtocolError as exc:
            raise TraceError(f"{trace_path}: {where} is not a valid frame: {exc}") from None
        except TraceError:
            raise
        except Exception as exc:  # a scheduler bug or an inconsistent trace: report, don't crash
            return SchedulerReplayReport(steps, f"{where}: the scheduler raised {type(exc).__name__}: {exc}")
    return SchedulerReplayReport(steps, torn_tail=trace.torn_tail)


def _lora_difference(recorded: Optional[tuple[m.LoRAStep, bytes]], replayed: Optional[m.LoRAStep],
                     step: int) -> Optional[str]:
    """How the LoRAStep recorded before step ``step`` differs from the replayed one; None: identical."""
    if recorded is None and replayed is None:
        return None
    if recorded is None:
        return f"step {step}: replayed a LoRAStep {replayed!r}, none was recorded"
    if replayed is None:
        return f"step {step}: recorded a LoRAStep {recorded[0]!r}, none was replayed"
    if encode(replayed) != recorded[1]:
        return f"step {step}'s LoRAStep: " + first_difference(recorded[0], replayed)
    return None


def _require(sched: Optional[Scheduler], path: str, where: str) -> None:
    if sched is None:
        raise TraceError(f"{path}: {where} comes before the WorkerInit that sizes the cache")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="pagedserve.scheduler_proc.replay", description=__doc__)
    p.add_argument("trace")
    p.add_argument("--model", help="model directory, in place of the recorded one (for grammar masks)")
    ns = p.parse_args(argv)
    try:
        report = replay_scheduler(ns.trace, ns.model)
    except TraceError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    if report.torn_tail:
        print(f"scheduler replay: warning: {report.torn_tail}; replayed the records before it", file=sys.stderr)
    if report.ok:
        print(f"scheduler replay: {report.steps} steps, every SchedulerOutput identical")
        return 0
    print(f"scheduler replay: differs at {report.mismatch}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
