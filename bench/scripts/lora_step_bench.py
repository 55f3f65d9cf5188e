"""A decode step with LoRA adapters against the same step on the base model, in one process: the
0.5B shape (random weights, bfloat16 by default), N sequences over K adapters of the bench's rank-16
set (all seven projections), driven through tests/support/worker_harness.py's TrivialScheduler. The
two kinds of step alternate (base, adapters, base, ...) so a noisy machine slows both alike; prints
the median ms per decode step of each and their ratio, and with ``--profile`` torch's profiler table
of one adapter step.

    python bench/scripts/lora_step_bench.py [--seqs 32] [--adapters 8] [--dtype bfloat16] [--path native]
    python bench/scripts/lora_step_bench.py --threads 1 --cpu-time    # on cores other work shares: one thread's work
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from pagedserve.runtime.torch_env import apply_torch_env_defaults

apply_torch_env_defaults()
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.lora import adapter_message  # noqa: E402
from support.worker_harness import GREEDY, TrivialScheduler  # noqa: E402

from pagedserve.bench.shapes import SHAPES, ensure_shape_model, shape_cache_dir  # noqa: E402
from pagedserve.worker_proc.model_runner import ModelRunner  # noqa: E402
from pagedserve.worker_proc.models import lora_linear  # noqa: E402
from pagedserve.worker_proc.models.lora_linear import LoRAConfig  # noqa: E402


def decode_steps(runner: ModelRunner, seqs: int, adapters: list, steps: int, prompt_len: int,
                 around=contextlib.nullcontext, clock=time.perf_counter, prefill: Optional[list] = None) -> list[float]:
    """ms of each decode step of ``seqs`` sequences (sequence i on slot i % len(adapters); none: base); the
    step of every prompt's prefill appended to ``prefill``."""
    sched = TrivialScheduler(runner, block_size=16, num_gpu_blocks=seqs * 8, num_cpu_blocks=0, max_model_len=512)
    for slot, adapter in enumerate(adapters):
        sched.load_lora(slot, adapter)
    for i in range(seqs):
        prompt = [(7 * i + j) % 1000 + 3 for j in range(prompt_len)]
        sched.add(f"r{i}", prompt, steps + 1, GREEDY, lora_slot=i % len(adapters) if adapters else -1)
    started = clock()
    sched.step_once()  # every prefill (and, the first time, the adapters' loads into their slots)
    if prefill is not None:
        prefill.append(1e3 * (clock() - started))
    times = []
    with around():
        for _ in range(steps):
            started = clock()
            sched.step_once()
            times.append(1e3 * (clock() - started))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--path", choices=lora_linear.PATHS, default=None, help="every step's path (default: by its size)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads (default: torch's own)")
    p.add_argument("--cpu-time", action="store_true", help="the process's CPU time (all threads), not wall time: "
                   "where other work shares the cores, what the steps cost rather than how long they waited")
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.path is not None:
        lora_linear.choose_path = lambda device, num_tokens: ns.path
    model = ensure_shape_model(SHAPES["0.5b-bf16"])
    adapter_dir = shape_cache_dir() / "0.5b-bf16-lora-r16"
    adapters = [adapter_message(f"a{i}", str(adapter_dir / f"a{i}"), i + 1) for i in range(ns.adapters)]
    runner = ModelRunner(str(model), dtype=ns.dtype, lora=LoRAConfig(max_loras=ns.adapters, max_rank=16))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {ns.dtype}, {ns.seqs} sequences, "
          f"{ns.adapters} adapters of rank 16 on all seven projections; deltas: "
          f"{ns.path or lora_linear.path_description(runner.device)}", flush=True)
    base, lora, base_prefill, lora_prefill = [], [], [], []
    clock = time.process_time if ns.cpu_time else time.perf_counter
    for _ in range(ns.rounds):
        base += decode_steps(runner, ns.seqs, [], ns.steps, ns.prompt_len, clock=clock, prefill=base_prefill)
        lora += decode_steps(runner, ns.seqs, adapters, ns.steps, ns.prompt_len, clock=clock, prefill=lora_prefill)
    kind = "CPU" if ns.cpu_time else "wall"
    b, a = statistics.median(base), statistics.median(lora)
    print(f"decode step ({kind} time): base {b:.1f} ms, adapters {a:.1f} ms; "
          f"base / adapters = {b / a:.3f} (tok/s ratio, adapters over base)")
    if ns.rounds > 1:  # the first round's prefill loads the adapters into their slots (they stay for the rest)
        b, a = statistics.median(base_prefill[1:]), statistics.median(lora_prefill[1:])
        print(f"prefill step of {ns.seqs} x {ns.prompt_len} tokens ({kind} time, rounds 2-{ns.rounds}): base {b:.1f} ms, "
              f"adapters {a:.1f} ms; base / adapters = {b / a:.3f}")
    if ns.profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        decode_steps(runner, ns.seqs, adapters, 2, ns.prompt_len, around=lambda: prof)
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=30, max_shapes_column_width=70))


if __name__ == "__main__":
    main()
