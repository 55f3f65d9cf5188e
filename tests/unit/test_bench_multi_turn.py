"""The multi-turn workload's client side: what each turn sends, and the users' think time."""

from __future__ import annotations

import argparse
import asyncio
import time

from pagedserve.bench import multi_turn as bench_multi_turn


def _ns(think_time: float) -> argparse.Namespace:
    return argparse.Namespace(num_conversations=3, num_turns=3, system_prompt_len=8, turn_len=4,
                              think_time=think_time, output_len=2, seed=0)


def _run(ns: argparse.Namespace) -> list[tuple[int, str, float, float]]:
    """(record index, prompt, sent at, answered at) per turn, answers taking 10 ms."""
    sent = []

    async def send(record, prompt, max_tokens):
        start = time.monotonic()
        await asyncio.sleep(0.01)
        sent.append((record.index, prompt, start, time.monotonic()))
        return f" answer{record.index}"

    asyncio.run(bench_multi_turn.run_conversations(ns, bench_multi_turn.conversation_records(ns), send))
    return sorted(sent)


def test_each_turn_carries_the_conversation_so_far_and_think_time_only_delays_it():
    at_once, thinking = _run(_ns(0.0)), _run(_ns(0.05))
    assert [p for _, p, _, _ in at_once] == [p for _, p, _, _ in thinking]  # same text at any pace
    first, second = at_once[0][1], at_once[1][1]
    assert second.startswith(first + " answer0\nUser: ")  # history, the answer, then a new message
    gaps = {True: [], False: []}
    for run, paused in ((at_once, False), (thinking, True)):
        for (i, _, _, answered), (j, _, started, _) in zip(run, run[1:]):
            if j == i + 1 and j % 3:  # the same conversation's next turn
                gaps[paused].append(started - answered)
    # the seeded draws (50 ms mean) for these six pauses sum to 0.38 s
    assert sum(gaps[False]) < 0.05 and sum(gaps[True]) > 0.3
