"""Scheduler + block manager cost per step, without a model.

Default: N running decode sequences (prompts uniform in 100..1024 tokens) for N in
256/1024/4096, block sizes 16 and 256, prefix caching off and on; times ``schedule()``
plus ``update_from_output()`` with fabricated StepResults (the fabrication is not timed)
and prints microseconds per running sequence per step, with Python's cyclic garbage
collector as it is by default and paused during the timed steps (what the scheduler
itself costs, without the collector walking the process's objects).

``--soak``: a steady workload (requests arriving and finishing) for many steps; reports
traced Python memory and RSS growth between an early and the final sample.

    python bench/scripts/scheduler_bench.py
    python bench/scripts/scheduler_bench.py --soak --steps 100000
    python bench/scripts/scheduler_bench.py --policies   # each --scheduling-policy at 1,024 running

``--nano-vllm DIR``: the same steady decodes through nano-vllm's scheduler and block manager (a
checkout's ``nanovllm/engine/``; needs ``xxhash``), block 256 (the only size it takes), which
always names full blocks for its prefix cache: its row sits beside ours at block 256, prefix on.

    python bench/scripts/scheduler_bench.py --nano-vllm /tmp/nano-vllm --block-sizes 256

``--policies``: the steady-decode cost under each scheduling policy, 1,024 running, block 16,
prefix cache off; requests alternate between two tenants and two priorities (0 under fcfs and
fair), and under deadline each carries a deadline_s (none due).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import statistics
import sys
import time
import tracemalloc
import types

import psutil

from pagedserve.protocol.messages import AddRequest, SamplingParams, StepResult
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

TOKEN = 5  # never an eos id here
_TOKENS = range(10, 30000)


class FakeDriver:
    """Plays the driver worker: tracks each request's token count and samples ``TOKEN``."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def step(self, out) -> StepResult:
        counts = self.num_tokens
        for req_id in out.finished_req_ids:
            del counts[req_id]
        ids = []
        for r in out.new_requests:
            counts[r.req_id] = len(r.token_ids)
            if r.num_computed_tokens + r.num_scheduled_tokens == len(r.token_ids):
                ids.append(r.req_id)
        for r in out.cached_requests:
            total = counts[r.req_id] + len(r.new_token_ids)
            counts[r.req_id] = total
            if r.num_computed_tokens + r.num_scheduled_tokens == total:
                ids.append(r.req_id)
        decodes = out.decodes.req_ids  # each decode samples
        for req_id in decodes:
            counts[req_id] += 1
        ids += decodes
        return StepResult(step=out.step, rank=0, req_ids=ids, sampled_token_ids=[TOKEN] * len(ids))


def add(sched: Scheduler, request_id: str, prompt_len: int, max_tokens: int, rng: random.Random,
        prefix: tuple = (), index: int = 0) -> None:
    prompt = list(prefix) + rng.choices(_TOKENS, k=prompt_len)
    policy = sched.config.scheduling_policy
    sched.add_request(AddRequest(request_id=request_id, prompt_token_ids=prompt,
                                 sampling=SamplingParams(max_tokens=max_tokens, seed=1),
                                 priority=index % 2 if policy in ("priority", "deadline") else 0,
                                 tenant="ab"[index % 2], deadline_s=3600.0 if policy == "deadline" else None))


def steady_decode_cost(num_seqs: int, block_size: int, prefix: bool, steps: int,
                       warmup: int = 50, policy: str = "fcfs") -> tuple[float, float]:
    """Microseconds per running sequence per step once all ``num_seqs`` are decoding:
    ``steps`` steps with the collector as it is by default, then ``steps`` with it paused."""
    rng = random.Random(0)
    max_len = 1024 + 2 * steps + warmup + 64
    blocks = num_seqs * (-(-max_len // block_size)) + 16
    config = SchedulerConfig(block_size=block_size, num_gpu_blocks=blocks, max_num_seqs=num_seqs,
                             max_num_batched_tokens=num_seqs * 1100, max_model_len=max_len,
                             enable_prefix_caching=prefix, scheduling_policy=policy)
    sched = Scheduler(config)
    driver = FakeDriver()
    for i in range(num_seqs):
        add(sched, f"req-{i}", rng.randint(100, 1024), 2 * steps + warmup + 32, rng, index=i)
    # Prefill, then untimed decodes: the first steps at a new size grow the heap (page
    # faults on fresh memory), which a serving process pays once, not every step.
    for _ in range(3 + warmup):
        out = sched.schedule()
        sched.update_from_output(out, driver.step(out))
    assert sched.stats()["num_running"] == num_seqs
    costs = timed_steps(sched.schedule, driver.step, sched.update_from_output, steps, num_seqs)
    assert sched.stats()["num_preemptions_recompute"] == 0
    return costs


def timed_steps(schedule, fabricate, update, steps: int, num_seqs: int) -> tuple[float, float]:
    """Microseconds per sequence per step of ``out = schedule()`` and ``update(out, fabricate(out))``
    (the fabrication not timed): ``steps`` with the collector as it is, then ``steps`` with it paused."""
    costs = []
    for collect in (True, False):
        gc.collect()
        if not collect:
            gc.disable()
        elapsed = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            out = schedule()
            mid = time.perf_counter()
            result = fabricate(out)
            resume = time.perf_counter()
            update(out, result)
            elapsed += (mid - start) + (time.perf_counter() - resume)
        gc.enable()
        costs.append(elapsed / steps / num_seqs * 1e6)
    return costs[0], costs[1]


SIZES = (256, 1024, 4096)


def load_nano_vllm(root: str):
    """nano-vllm's Scheduler class from a checkout, without its package (torch, the model runner)."""
    for name in ("nanovllm", "nanovllm.engine"):
        sys.modules.setdefault(name, types.ModuleType(name))
    config = sys.modules["nanovllm.config"] = types.ModuleType("nanovllm.config")
    config.Config = types.SimpleNamespace
    for name in ("sampling_params", "engine.sequence", "engine.block_manager", "engine.scheduler"):
        spec = importlib.util.spec_from_file_location(f"nanovllm.{name}", f"{root}/nanovllm/{name.replace('.', '/')}.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["nanovllm.engine.scheduler"].Scheduler, sys.modules["nanovllm.engine.sequence"].Sequence


def nano_decode_cost(nano, num_seqs: int, steps: int, warmup: int = 50) -> tuple[float, float]:
    """``steady_decode_cost`` for nano-vllm: ``schedule()`` + ``postprocess()`` at block 256."""
    scheduler_class, sequence_class = nano
    params = sys.modules["nanovllm.sampling_params"].SamplingParams
    rng = random.Random(0)
    max_len = 1024 + 2 * steps + warmup + 64
    block_size = 256
    sched = scheduler_class(types.SimpleNamespace(
        max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * 1100, eos=-1, kvcache_block_size=block_size,
        num_kvcache_blocks=num_seqs * (-(-max_len // block_size)) + 16))
    for _ in range(num_seqs):
        sched.add(sequence_class(rng.choices(_TOKENS, k=rng.randint(100, 1024)),
                                 params(max_tokens=2 * steps + warmup + 32)))
    for _ in range(3 + warmup):
        seqs, is_prefill = sched.schedule()
        sched.postprocess(seqs, [TOKEN] * len(seqs), is_prefill)
    assert len(sched.running) == num_seqs and not sched.waiting
    return timed_steps(sched.schedule, lambda out: [TOKEN] * len(out[0]),
                       lambda out, tokens: sched.postprocess(out[0], tokens, out[1]), steps, num_seqs)


def table(steps: int, runs: int, block_sizes=(16, 256), nano_root=None) -> None:
    # Runs of one configuration swing by up to 1.5x on a shared machine (heap layout, other
    # load): the sizes are measured in turn, ``runs`` times, and each cell is a median.
    print("us per running sequence per step (schedule + update_from_output), "
          f"median of {runs} runs of {steps} steps")
    print("| running | block size | prefix cache | default gc | gc paused |")
    print("|--------:|-----------:|:------------:|-----------:|----------:|")
    results = {}
    nano = load_nano_vllm(nano_root) if nano_root else None
    for block_size in block_sizes:
        for prefix in (False, True):
            samples = {n: [] for n in SIZES}
            nano_samples = {n: [] for n in SIZES}
            for _ in range(runs):
                for num_seqs in SIZES:
                    samples[num_seqs].append(steady_decode_cost(num_seqs, block_size, prefix, steps))
                    if nano and block_size == 256 and prefix:  # in turn with ours, so load drifts alike
                        nano_samples[num_seqs].append(nano_decode_cost(nano, num_seqs, steps))
            for num_seqs in SIZES:
                cost = statistics.median(on for on, _ in samples[num_seqs])
                paused = statistics.median(off for _, off in samples[num_seqs])
                results[(num_seqs, block_size, prefix)] = (cost, paused)
                print(f"| {num_seqs:7d} | {block_size:10d} | {'on' if prefix else 'off':^12} | {cost:10.3f} "
                      f"| {paused:9.3f} |", flush=True)
            for num_seqs in SIZES if nano_samples[SIZES[0]] else ():
                cost = statistics.median(on for on, _ in nano_samples[num_seqs])
                paused = statistics.median(off for _, off in nano_samples[num_seqs])
                ours = results[(num_seqs, block_size, prefix)]
                results[("nano", num_seqs)] = (cost, paused)
                print(f"| {num_seqs:7d} | nano-vllm {block_size:3d} | {'on':^12} | {cost:10.3f} | {paused:9.3f} | "
                      f"nano / ours: {cost / ours[0]:.2f}x, {paused / ours[1]:.2f}x", flush=True)
    for block_size in block_sizes:
        for prefix in (False, True):
            (big, big_paused), (mid, mid_paused) = results[(4096, block_size, prefix)], results[(1024, block_size, prefix)]
            print(f"step cost 4096 vs 1024 (block {block_size}, prefix {'on' if prefix else 'off'}): "
                  f"{4 * big / mid:.2f}x with default gc, {4 * big_paused / mid_paused:.2f}x with gc paused")


def policies(steps: int, runs: int) -> None:
    names = ("fcfs", "priority", "deadline", "fair")
    samples = {name: [] for name in names}
    for _ in range(runs):
        for name in names:  # in turn, so drifting load touches each alike
            samples[name].append(steady_decode_cost(1024, 16, False, steps, policy=name))
    print(f"us per running sequence per step at 1,024 running (block 16, prefix off), median of {runs} runs of "
          f"{steps} steps")
    print("| policy | default gc | gc paused | / fcfs (gc paused) |")
    print("|:-------|-----------:|----------:|-------------------:|")
    base = statistics.median(off for _, off in samples["fcfs"])
    for name in names:
        cost = statistics.median(on for on, _ in samples[name])
        paused = statistics.median(off for _, off in samples[name])
        print(f"| {name} | {cost:.3f} | {paused:.3f} | {paused / base:.2f}x |", flush=True)


def soak(steps: int, concurrency: int, trace: bool) -> None:
    """Shared prefixes (cache hits), a cache small enough to preempt (swap and recompute), aborts."""
    rng = random.Random(0)
    prefixes = [tuple(rng.randrange(10, 30000) for _ in range(64)) for _ in range(8)]
    config = SchedulerConfig(block_size=16, num_gpu_blocks=640, num_cpu_blocks=128, max_num_seqs=concurrency,
                             max_num_batched_tokens=2048, max_model_len=1024, enable_prefix_caching=True)
    sched = Scheduler(config)
    driver = FakeDriver()
    process = psutil.Process()
    next_id = 0
    if trace:
        tracemalloc.start()
    baseline = None
    start = time.perf_counter()
    for step in range(steps):
        while len(sched.requests) < concurrency:
            add(sched, f"soak-{next_id}", rng.randint(16, 300), rng.randint(8, 200), rng, rng.choice(prefixes))
            next_id += 1
        if step % 97 == 0 and sched.requests:
            sched.abort_requests([next(iter(sched.requests))])
        out = sched.schedule()
        sched.update_from_output(out, driver.step(out))
        if step == steps // 10:
            gc.collect()
            baseline = (tracemalloc.get_traced_memory()[0], process.memory_info().rss)
    gc.collect()
    traced, rss = tracemalloc.get_traced_memory()[0], process.memory_info().rss
    if trace:
        tracemalloc.stop()
    seconds = time.perf_counter() - start
    print(f"soak: {steps} steps, {next_id} requests, {seconds:.1f} s")
    if trace:
        print(f"traced Python memory growth since step {steps // 10}: {(traced - baseline[0]) / 2**20:.3f} MiB")
    print(f"RSS growth since step {steps // 10}: {(rss - baseline[1]) / 2**20:.3f} MiB")
    print(f"stats: {sched.stats()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 400 per mode; soak 100000)")
    parser.add_argument("--runs", type=int, default=5, help="runs per cell; the table shows medians")
    parser.add_argument("--soak", action="store_true", help="long steady workload; report memory growth")
    parser.add_argument("--concurrency", type=int, default=64, help="soak: requests in flight")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="soak: also trace Python allocations (about 2x slower; its own bookkeeping adds RSS)")
    parser.add_argument("--policies", action="store_true", help="the cost under each --scheduling-policy")
    parser.add_argument("--nano-vllm", metavar="DIR", help="also nano-vllm's scheduler, from this checkout")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256], help="block sizes of the table")
    args = parser.parse_args()
    if args.policies:
        policies(args.steps or 400, args.runs)
    elif args.soak:
        soak(args.steps or 100_000, args.concurrency, args.tracemalloc)
    else:
        table(args.steps or 400, args.runs, tuple(args.block_sizes), args.nano_vllm)


if __name__ == "__main__":
    main()
