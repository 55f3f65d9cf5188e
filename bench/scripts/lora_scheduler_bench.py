"""LoRA admission without a model: how many sequences run, and how long requests wait to start,
when requests of more adapters than ``--max-loras`` slots share one scheduler.

A closed loop keeps ``--pool`` x max_num_seqs requests in the scheduler, each of the base model or
one of ``--adapters`` adapters (uniform), prompts of 50..400 tokens and 16..128 output tokens; the
fabricated results never stop a sequence early (scheduler_bench.py's FakeDriver). Prints, per row,
the mean running sequences, the waits (steps from arrival to first scheduled) of the requests that
started, the oldest request still waiting at the end, and the scheduler's microseconds per step.

    python bench/scripts/lora_scheduler_bench.py                # base model; 4 slots; 8 slots
    python bench/scripts/lora_scheduler_bench.py --no-drain     # 4 slots without the drain (starves)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import random
import time
from pathlib import Path

from pagedserve.protocol.messages import AddRequest, LoRAAdapter, SamplingParams
from pagedserve.scheduler_proc import lora_slots
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

_spec = importlib.util.spec_from_file_location("scheduler_bench", Path(__file__).with_name("scheduler_bench.py"))
scheduler_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scheduler_bench)


def run(max_loras: int, num_adapters: int, steps: int, seats: int, pool: float, seed: int = 0) -> str:
    rng = random.Random(seed)
    lora = max_loras > 0
    config = SchedulerConfig(block_size=16, num_gpu_blocks=seats * 80, max_num_seqs=seats,
                             max_num_batched_tokens=8192, max_model_len=2048, enable_lora=lora,
                             max_loras=max(max_loras, 1))
    adapters = [LoRAAdapter(f"l{i}", i + 1, "/adapters", hashlib.sha256(b"%d" % i).hexdigest())
                for i in range(num_adapters)] if lora else []
    sched = Scheduler(config, lora_adapters=adapters)
    driver = scheduler_bench.FakeDriver()
    names = ["", *(a.name for a in adapters)] if lora else [""] * (num_adapters + 1)
    count, arrived, waits, running, elapsed = 0, {}, [], 0, 0.0
    for step in range(steps):
        while len(sched.requests) < seats * pool:
            sched.add_request(AddRequest(f"r{count}", rng.choices(range(10, 30000), k=rng.randint(50, 400)),
                                         SamplingParams(max_tokens=rng.randint(16, 128), seed=1),
                                         lora_name=rng.choice(names)))
            arrived[f"r{count}"] = step
            count += 1
        start = time.perf_counter()
        out = sched.schedule()
        sched.take_lora_step()
        elapsed += time.perf_counter() - start
        for new in out.new_requests:
            if new.req_id in arrived:
                waits.append(step - arrived.pop(new.req_id))
        result = driver.step(out)
        start = time.perf_counter()
        sched.update_from_output(out, result)
        elapsed += time.perf_counter() - start
        running += len(sched.running)
    waits.sort()
    oldest = max((steps - at for at in arrived.values()), default=0)
    label = f"{max_loras} slots" if lora else "base model"
    return (f"| {label:10} | {running / steps:7.0f} | {len(waits):7} | {waits[len(waits) // 2]:5} | "
            f"{waits[int(len(waits) * 0.99)]:5} | {waits[-1]:5} | {oldest:6} | {elapsed / steps * 1e6:7.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seats", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--pool", type=float, default=4.0, help="requests in the scheduler, times --seats")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--no-drain", action="store_true", help="never drain a resident adapter (shows starvation)")
    ns = parser.parse_args()
    if ns.no_drain:
        lora_slots.LoRASlots.hold_back = lambda self, adapter: None
    print(f"{ns.adapters} adapters + base, uniform; {ns.seats} seats, {ns.pool:g}x in the scheduler; {ns.steps} steps"
          + (" (no drain)" if ns.no_drain else ""))
    print("| slots      | running | started | p50   | p99   | max   | oldest | us/step |")
    print("|------------|---------|---------|-------|-------|-------|--------|---------|")
    for max_loras in ([4] if ns.no_drain else [0, 4, 8]):
        print(run(max_loras, ns.adapters, ns.steps, ns.seats, ns.pool))


if __name__ == "__main__":
    main()
