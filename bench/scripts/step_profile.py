"""One process, no IPC: the real Scheduler driving the real ModelRunner, timed per phase.

Splits a run into scheduler time (schedule + update_from_output) and worker time
(ModelRunner.execute), and optionally profiles it with cProfile, to find what bounds
throughput before any socket is involved. ``--phases`` splits the worker's step into
matmuls, attention, norms and activations, sampling, input preparation, ... (bench/scripts/step_phases.py),
per step kind, and adds the msgpack encode + decode both ways that IPC costs (not the socket).

    python bench/scripts/step_profile.py MODEL_DIR --num-prompts 64 --output-len 64 [--profile] [--phases]
    python bench/scripts/step_profile.py --shape 0.5b --num-prompts 32 --input-len 8 256 --output-len 8 --phases
    python bench/scripts/step_profile.py --shape 0.5b --num-prompts 32 --input-len 8 256 --output-len 32 \
        --dtype bfloat16 --phases --limits
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections import defaultdict, deque

from pagedserve.runtime.torch_env import apply_torch_env_defaults

apply_torch_env_defaults()  # as a worker does, before torch loads
import torch  # noqa: E402

from pagedserve.protocol import messages as m
from pagedserve.runtime.options import default_step_tokens
from pagedserve.protocol.codec import Decoder, encode
from pagedserve.protocol.messages import AddRequest, SamplingParams, WorkerInit
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.worker_proc.host_memory import keep_freed_memory
from pagedserve.worker_proc.model_runner import ModelRunner
from step_phases import PHASES, format_limits, format_machine_limits, format_phases, instrument_worker, machine_limits


CACHE_TOKENS = 65536


def run(ns: argparse.Namespace) -> None:
    runner = ModelRunner(ns.model, device=ns.device, dtype=ns.dtype)
    num_gpu_blocks = ns.num_gpu_blocks or CACHE_TOKENS // ns.block_size
    cfg = SchedulerConfig(block_size=ns.block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=ns.max_num_seqs,
                          max_num_batched_tokens=ns.max_num_batched_tokens or default_step_tokens(ns.device),
                          max_model_len=4096)
    runner.init_cache(WorkerInit(block_size=ns.block_size, num_gpu_blocks=cfg.num_gpu_blocks,
                                 num_cpu_blocks=0, max_model_len=4096, seed=0))
    sched = Scheduler(cfg)
    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    lens = ns.prompt_lens or [rng.randint(*ns.input_len) for _ in range(ns.num_prompts)]
    ns.num_prompts = len(lens)
    for i, n in enumerate(lens):
        prompt = [rng.randrange(3, 1000) for _ in range(n)]
        sched.add_request(AddRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=sampling))
    t_sched = t_exec = 0.0
    steps = 0
    # Worker ms per step by kind: ("decode", batch size) for pure-decode steps,
    # ("prefill", tokens) for steps with any prefill chunk.
    by_kind: dict[tuple[str, int], list[float]] = defaultdict(list)
    clock = time.thread_time if ns.cpu_time else time.perf_counter
    timer = instrument_worker(runner, clock) if ns.phases else None
    gaps = DeviceGaps(runner) if ns.gpu_gaps else None
    to_worker, to_scheduler = Decoder(m.SchedulerToWorker), Decoder(m.WorkerToScheduler)
    phases_by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    steps_by_kind: dict[str, list[float]] = defaultdict(list)
    work_by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    start = clock()
    queued: deque = deque()  # with --ahead, the step scheduled before this one's result, as the engine does
    while sched.has_unfinished() or queued:
        t0 = clock()
        out = queued.popleft() if queued else sched.schedule()
        if ns.ahead and sched.has_unfinished() and sched.can_schedule_ahead():
            queued.append(sched.schedule())
        t1 = clock()
        if timer is not None:
            with timer.phase("IPC encode/decode"):
                sent = to_worker.decode(encode(out))
            t1 = clock()
            result = runner.execute(sent)
            t2 = clock()
            with timer.phase("IPC encode/decode"):
                result = to_scheduler.decode(encode(result))
        else:
            if gaps is not None:
                gaps.begin()
            result = runner.execute(out, peek=(lambda: queued[0] if queued else None) if ns.ahead else None)
            t2 = clock()
            if gaps is not None:
                n_reqs = len(out.new_requests) + len(out.cached_requests) + len(out.decodes.req_ids)
                gaps.end(t2 - t1, out.total_num_scheduled_tokens == n_reqs)
        sched.update_from_output(out, result)
        t3 = clock()
        if timer is not None:
            n_reqs = len(out.new_requests) + len(out.cached_requests) + len(out.decodes.req_ids)
            kind = "decode" if out.total_num_scheduled_tokens == n_reqs else "prefill"
            phases = timer.take()
            phases["other (in forward)"] = (t2 - t1) - sum(v for k, v in phases.items() if k != "IPC encode/decode")
            for name, seconds in phases.items():
                phases_by_kind[kind][name] += seconds
            for name, amount in timer.take_work().items():
                work_by_kind[kind][name] += amount
            steps_by_kind[kind].append(t2 - t1)
        t_sched += (t1 - t0) + (t3 - t2)
        t_exec += t2 - t1
        steps += 1
        n_reqs = len(out.new_requests) + len(out.cached_requests) + len(out.decodes.req_ids)
        if n_reqs:
            decode_only = out.total_num_scheduled_tokens == n_reqs
            kind = ("decode", n_reqs) if decode_only else ("prefill", out.total_num_scheduled_tokens)
            by_kind[kind].append(1e3 * (t2 - t1))
    total = clock() - start
    tokens = ns.num_prompts * ns.output_len
    print(f"{steps} steps, {total:.2f}s, {tokens / total:.0f} tok/s; scheduler {1e3 * t_sched / steps:.2f} ms/step, "
          f"worker execute {1e3 * t_exec / steps:.2f} ms/step (threads {torch.get_num_threads()})")
    for kind, times in sorted(steps_by_kind.items()):
        per_step = {name: 1e3 * phases_by_kind[kind][name] / len(times) for name in PHASES}
        print(format_phases(per_step, 1e3 * statistics.fmean(times),
                            f"{kind} steps ({len(times)}), mean ms per step by phase:"))
    if ns.limits:
        limits = machine_limits(runner.dtype)
        print(f"this machine, {runner.dtype} (timed now):\n{format_machine_limits(limits)}")
        for kind, times in sorted(steps_by_kind.items()):
            n = len(times)
            print(f"{kind} steps, per step against those limits:\n" + format_limits(
                {k: v / n for k, v in work_by_kind[kind].items()},
                {k: v / n for k, v in phases_by_kind[kind].items()}, statistics.fmean(times), limits))
    if gaps is not None:
        print(gaps.report())
    if ns.by_kind:
        print("worker execute by step kind (median ms over steps of that kind):")
        for (kind, n), times in sorted(by_kind.items()):
            label = f"{n} decodes" if kind == "decode" else f"prefill, {n} tokens"
            print(f"  {label:<24}{statistics.median(times):8.3f} ms  ({len(times)} steps)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", nargs="?", help="model directory (or --shape)")
    p.add_argument("--shape", help="a built-in bench shape instead: tiny, small, 0.5b")
    p.add_argument("--phases", action="store_true", help="worker time per phase, per step kind")
    p.add_argument("--limits", action="store_true",
                   help="with --phases: matmul TFLOP/s and bytes/s per step kind against this machine's own "
                        "peak matmul and memory bandwidth, timed at the end of the run")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 64])
    p.add_argument("--prompt-lens", type=int, nargs="+", help="explicit prompt lengths (replaces the random ones)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="running requests at most: with more prompts, a served closed loop's mixed steps")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help=f"default: {CACHE_TOKENS} tokens' worth")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step; default: the engine's for the device")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--torch-profile", action="store_true",
                   help="torch.profiler over the last repeat: the ops and kernels by device time")
    p.add_argument("--gpu-gaps", action="store_true",
                   help="on CUDA: where a decode step's wall time goes, by device events: the device idle "
                        "while the host prepares inputs, the forward, logits and sampling")
    p.add_argument("--ahead", action="store_true",
                   help="schedule the next step before this one's result where the scheduler allows (async "
                        "scheduling), and let the runner prepare it while this one samples (not with --phases)")
    p.add_argument("--by-kind", action="store_true", help="median worker ms per step kind (batch size, prefill)")
    p.add_argument("--threads", type=int)
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this thread's CPU time (robust to other load; use with --threads 1)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the workload this many times in one process (the first warms allocator and kernels)")
    p.add_argument("--malloc-default", action="store_true",
                   help="leave glibc's malloc thresholds alone (the worker process raises them)")
    ns = p.parse_args()
    ns.phases = ns.phases or ns.limits
    if ns.ahead and ns.phases:
        p.error("--ahead runs a step's preparation inside the one before: not with --phases")
    if ns.gpu_gaps and (ns.phases or not ns.device.startswith("cuda")):
        p.error("--gpu-gaps times device events: CUDA only, and not with --phases")
    if not ns.malloc_default:
        keep_freed_memory()  # as the worker process does (worker_proc/host_memory.py)
    if ns.shape:
        from pagedserve.bench.shapes import SHAPES, ensure_shape_model

        ns.model = str(ensure_shape_model(SHAPES[ns.shape]))
    if not ns.model:
        p.error("give a model directory or --shape")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.profile:
        prof = cProfile.Profile()
        prof.runcall(run, ns)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    else:
        for _ in range(ns.repeat - 1 if ns.torch_profile else ns.repeat):
            run(ns)
        if ns.torch_profile:
            torch_profile(ns)


class DeviceGaps:
    """Device events at a step's start, at the forward's launch and at the logits' launch.

    The device reaches an event at once when idle, so start -> forward is the time it waited for
    the host's input preparation; forward -> logits is the model's own time; logits -> the end of
    execute is the logits, sampling and whatever the host did before its last read."""

    def __init__(self, runner):
        self.runner, self.marks, self.rows = runner, {}, []
        for owner, name in ((runner.model, "forward"), (runner.model, "compute_logits")):
            self._wrap(owner, name)
        self._graphs_wrapped = False

    def _wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.marks.setdefault(name, self._event())
            return inner(*args, **kwargs)

        setattr(owner, name, wrapped)

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        if not self._graphs_wrapped and self.runner.decode_graphs is not None:
            self._wrap(self.runner.decode_graphs, "forward")  # a replay is a forward too
            self._graphs_wrapped = True
        self.marks = {"start": self._event()}

    def end(self, wall_s: float, decode_only: bool) -> None:
        done = self._event()
        torch.cuda.synchronize()
        m = self.marks
        if decode_only and "forward" in m and "compute_logits" in m:
            self.rows.append((1e3 * wall_s, m["start"].elapsed_time(m["forward"]),
                              m["forward"].elapsed_time(m["compute_logits"]), m["compute_logits"].elapsed_time(done)))

    def report(self) -> str:
        if not self.rows:
            return "device gaps: no decode step was timed"
        cols = [statistics.median(c) for c in zip(*self.rows)]
        return (f"decode steps ({len(self.rows)}), median ms: execute wall {cols[0]:.3f}; device idle for input "
                f"preparation {cols[1]:.3f}, forward {cols[2]:.3f}, logits + sampling + host tail {cols[3]:.3f}")


def torch_profile(ns: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ns.device.startswith("cuda") else [])
    with profile(activities=activities, with_stack=ns.device.startswith("cuda")) as prof:
        run(ns)
    key = "self_device_time_total" if ns.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
    # Where the host copies and waits: each copy or device read under the Python lines that made it.
    sites: dict[tuple[str, tuple[str, ...]], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.name not in ("aten::copy_", "aten::item", "aten::pin_memory", "cudaStreamSynchronize"):
            continue
        frames, parent = [], e.cpu_parent
        while parent is not None and len(frames) < 3:
            if ".py(" in parent.name and "torch/" not in parent.name:
                frames.append(parent.name[-70:])
            parent = parent.cpu_parent
        site = sites[(e.name, tuple(frames))]
        site[0] += 1
        site[1] += e.cpu_time_total / 1e3
    for (name, frames), (count, ms) in sorted(sites.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"{name:<24} {count:6d} calls {ms:9.1f} ms host  " + " <- ".join(frames))


if __name__ == "__main__":
    main()
