"""A windowed model on a fixed cache, without a model: blocks held per sequence and sequences running
at once, with the blocks behind the window freed (``SchedulerConfig.sliding_window``) and kept (0).

``--requests`` requests arrive at once, each a ``--prompt`` token prompt and ``--new`` generated tokens
(the fabricated results never stop one early: scheduler_bench.py's FakeDriver). Prints, per row, the
most blocks one running sequence held, the mean and most sequences running per step, the preemptions,
the prompt and output tokens computed again after a preemption, the steps to finish them all and the
scheduler's microseconds per step (with this script's per-step count of blocks).

With ``--hybrid K``, the model's global and local layers alternate (protocol/kv_groups.py), K local KV
groups per global one (Gemma 2, gpt-oss: 1; Gemma 3: 5): the rows compare one table for every layer, every
block kept (``--blocks`` blocks spanning every layer), with a table per KV group in the same memory
(``(K + 1) x --blocks`` blocks of one group's layers), the local tables freed behind the window. Memory one
sequence held is then counted in pages of one group's layers in both rows.

    python bench/scripts/sliding_window_bench.py                      # Mistral-7B v0.1's window, 16-token blocks
    python bench/scripts/sliding_window_bench.py --window 512 --blocks 512
    python bench/scripts/sliding_window_bench.py --hybrid 1 --window 4096   # Gemma 2 / gpt-oss-like
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


def run(window: int, args, groups: int = 0) -> str:
    """``groups``: a hybrid model's local KV groups, a table each (``window`` theirs); 0: one table."""
    pages = 1 + args.hybrid  # one table's block spans every layer: this many pages of one group's layers
    blocks = args.blocks * pages if groups else args.blocks
    config = SchedulerConfig(block_size=args.block_size, num_gpu_blocks=blocks, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.step_tokens, max_model_len=args.prompt + args.new + 1,
                             sliding_window=0 if args.hybrid else window,
                             num_window_groups=groups, hybrid_window=window if groups else 0)
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
        most_blocks = max([most_blocks] + [held_pages(s, pages if args.hybrid and not groups else 1) for s in running])
    elapsed = time.perf_counter() - started  # includes the per-step check above
    stats = sched.stats()
    preemptions = stats["num_preemptions_recompute"] + stats["num_preemptions_swap"]
    label = (f"{groups} local table(s) freed behind {window}" if groups else "one table, every block kept"
             ) if args.hybrid else (f"freed behind {window}" if window else "kept (no freeing)")
    return (f"| {label} | {most_blocks} | {running_sum / steps:.1f} | {most_running} | {preemptions} "
            f"| {stats['recomputed_tokens']} | {steps} | {elapsed / steps * 1e6:.0f} |")


def held_pages(seq, pages_per_block: int) -> int:
    """Device blocks ``seq``'s tables hold, each ``pages_per_block`` pages of one KV group's layers."""
    live = len(seq.block_ids) - seq.num_freed_blocks
    live += sum(len(table) - seq.num_window_freed for table in seq.window_tables)
    return live * pages_per_block


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
    parser.add_argument("--hybrid", type=int, default=0, help="local KV groups per global one (0: every layer windowed)")
    args = parser.parse_args()
    print(f"{args.requests} requests of {args.prompt} + {args.new} tokens; cache {args.blocks} blocks of "
          f"{args.block_size} tokens; window {args.window}\n")
    held = "most pages (one group's layers) one sequence held" if args.hybrid else "most blocks one sequence held"
    print(f"| blocks behind the window | {held} | mean running | most running "
          "| preemptions | tokens recomputed | steps | µs/step |")
    print("|---|---|---|---|---|---|---|---|")
    if args.hybrid:
        for groups in (0, args.hybrid):
            print(run(args.window, args, groups), flush=True)
        return
    for window in (0, args.window):
        print(run(window, args), flush=True)


if __name__ == "__main__":
    main()
