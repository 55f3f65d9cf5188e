"""A windowed model on a fixed cache, without a model: blocks held per sequence and sequences running
at once, with the blocks behind the window freed (``SchedulerConfig.sliding_window``) and kept (0).

``--requests`` requests arrive at once, each a ``--prompt`` token prompt and ``--new`` generated tokens
(the fabricated results never stop one early: scheduler_bench.py's FakeDriver). Prints, per row, the
most blocks one running sequence held, the mean and most sequences running per step, the preemptions,
the prompt and output tokens computed again after a preemption, the steps to finish them all and the
scheduler's microseconds per step (with this script's per-step count of blocks).

    python bench/scripts/sliding_window_bench.py                      # Mistral-7B v0.1's window, 16-token blocks
    python bench/scripts/sliding_window_bench.py --window 512 --blocks 512
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler

_spec = importlib.util.spec_from_file_location("scheduler_bench", Path(__file__).with_name("scheduler_bench.py"))
scheduler_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scheduler_bench)


def run(window: int, args) -> str:
    config = SchedulerConfig(block_size=args.block_size, num_gpu_blocks=args.blocks, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.step_tokens, max_model_len=args.prompt + args.new + 1,
                             sliding_window=window)
    sched = Scheduler(config)
    rng = random.Random(0)
    for i in range(args.requests):
        scheduler_bench.add(sched, f"r{i}", args.prompt, args.new, rng)
    driver = scheduler_bench.FakeDriver()
    steps = running_sum = most_running = most_blocks = 0
    started = time.perf_counter()
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, driver.step(out))
        steps += 1
        live = sched.running.check(AssertionError)
        running = live[0] + live[1]
        running_sum += len(running)
        most_running = max(most_running, len(running))
        most_blocks = max([most_blocks] + [len(s.block_ids) - s.num_freed_blocks for s in running])
    elapsed = time.perf_counter() - started  # includes the per-step check above
    stats = sched.stats()
    preemptions = stats["num_preemptions_recompute"] + stats["num_preemptions_swap"]
    label = f"freed behind {window}" if window else "kept (no freeing)"
    return (f"| {label} | {most_blocks} | {running_sum / steps:.1f} | {most_running} | {preemptions} "
            f"| {stats['recomputed_tokens']} | {steps} | {elapsed / steps * 1e6:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2048, help="device blocks (2048 x 16 = 32768 tokens)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=7680)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=2048)
    args = parser.parse_args()
    print(f"{args.requests} requests of {args.prompt} + {args.new} tokens; cache {args.blocks} blocks of "
          f"{args.block_size} tokens; window {args.window}\n")
    print("| blocks behind the window | most blocks one sequence held | mean running | most running "
          "| preemptions | tokens recomputed | steps | µs/step |")
    print("|---|---|---|---|---|---|---|---|")
    for window in (0, args.window):
        print(run(window, args), flush=True)


if __name__ == "__main__":
    main()
