"""Async scheduling's rule: when the next step may go out before the result of the one out.

Overlapped scheduling covers the steady state of plain decodes; everything else waits for
the result (docs/DECISIONS.md). Ahead is allowed when exactly one step is out and:

1. every sequence sampling in it is a steady decode (running.py), so no token a per-object
   sequence needs is unknown; except sequences that sit the step ahead out: grammar-constrained
   ones (never steady; their mask needs the token still in flight, so they wait for it, vLLM's
   choice) and ones sampling their way into the steady batch (a prompt's first token), which
   join it when their token arrives, while the step ahead is out (``is_steady_kind``); with no
   steady decode to overlap, nobody waits for nothing;
2. the free blocks cover every block the running sequences can ask for, so the step
   preempts nothing: no in-flight sequence is swapped or recomputed with a token still
   unknown, and no steady decode leaves the batch for the per-object path while its token is
   in flight.

Sequences with nothing to compute until the result arrives (a parent about to fork) simply
sit the step out. A steady decode that ends meanwhile holds nothing back: the batch out
that computes a token past its end drops it (running.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler_proc.running import is_steady_kind

if TYPE_CHECKING:
    from pagedserve.scheduler_proc.scheduler import Scheduler


def can_schedule_ahead(sched: "Scheduler") -> bool:
    in_flight = sched.in_flight
    if len(in_flight) != 1:
        return False
    sampling = in_flight[0][1]
    running = sched.running
    if sampling and not running.num_steady:  # only the ones sampling would run, and they sit it out
        return False
    for seq in sampling:
        # One of the steady kind joins the batch once its token is in: it sits out the step
        # ahead, then joins while that one is out. Any other (but a grammar's) keeps its
        # every-step decode by being waited for.
        if seq.grammar is None and not is_steady_kind(seq):
            return False
    bm = sched.bm
    free = bm.device.num_free - running.num_steady_needing_blocks()
    budget = sched.config.max_num_batched_tokens
    for seq in running.per_object():  # rule 2: an upper bound on what the per-object loop can take
        if free < 0:
            return False
        remaining = seq.target_len - seq.num_kv_tokens
        if remaining > 0:
            free -= bm.num_new_blocks(seq, min(remaining, budget))
    return free >= 0
