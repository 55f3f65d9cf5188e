"""What ``--record-trace`` costs the scheduler per step, without a model.

N running decode sequences (as in scheduler_bench.py); each timed step is what the engine
loop does anyway — ``schedule()``, encoding the SchedulerOutput, ``update_from_output()``
with a fabricated StepResult frame — and, when recording, the two trace appends the loop
adds (the to_worker and from_worker frames, already encoded, one flushed write each).

    python bench/scripts/trace_bench.py [--steps 300] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from scheduler_bench import FakeDriver, add  # noqa: E402 (run as a script from bench/)

from pagedserve.protocol.codec import encode
from pagedserve.protocol.trace import TraceWriter
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler


def step_cost(num_seqs: int, steps: int, trace_path: str | None) -> tuple[float, float]:
    """(microseconds per step, trace bytes per step) once ``num_seqs`` sequences decode."""
    rng = random.Random(0)
    max_len = 1024 + steps + 64
    config = SchedulerConfig(block_size=16, num_gpu_blocks=num_seqs * (-(-max_len // 16)) + 16,
                             max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * 1100,
                             max_model_len=max_len)
    sched, driver = Scheduler(config), FakeDriver()
    for i in range(num_seqs):
        add(sched, f"req-{i}", rng.randint(100, 1024), steps + 32, rng)
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, driver.step(out))
    writer = TraceWriter(trace_path) if trace_path else None
    start_bytes = os.path.getsize(trace_path) if trace_path else 0
    elapsed = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        frame = encode(out)
        if writer:
            writer.append("to_worker", frame)
        t1 = time.perf_counter()
        result = driver.step(out)
        result_frame = encode(result)  # the worker's work: not timed
        t2 = time.perf_counter()
        if writer:
            writer.append("from_worker", result_frame)
        sched.update_from_output(out, result)
        elapsed += (t1 - t0) + (time.perf_counter() - t2)
    size = os.path.getsize(trace_path) - start_bytes if trace_path else 0
    if writer:
        writer.close()
    return elapsed / steps * 1e6, size / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dir", default=None, help="where the trace file goes (default: the temp dir)")
    ns = p.parse_args()
    print("| running | us/step, no trace | us/step, recording | overhead | trace bytes/step |")
    print("|--------:|------------------:|-------------------:|---------:|-----------------:|")
    with tempfile.TemporaryDirectory(dir=ns.dir) as tmp:
        for num_seqs in (16, 256, 1024):
            base = min(step_cost(num_seqs, ns.steps, None)[0] for _ in range(3))
            rec, size = min(step_cost(num_seqs, ns.steps, os.path.join(tmp, f"t{num_seqs}.trace"))
                            for _ in range(3))
            print(f"| {num_seqs:7d} | {base:17.1f} | {rec:18.1f} | {100 * (rec - base) / base:7.1f}% "
                  f"| {size:16.0f} |", flush=True)


if __name__ == "__main__":
    main()
