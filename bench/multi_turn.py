"""``pagedserve bench serve --dataset multi-turn``: chat-like conversations that grow turn by turn.

C conversations of T turns run side by side. Each turn's prompt is the conversation so far
(an optional system prompt shared by every conversation, then each earlier user message and
the answer the server gave to it) plus a new user message; a conversation sends its next turn
only when the previous answer has arrived and its user has thought for a while (``--think-time``,
exponential, so conversations drift apart as real ones do). Prompts are text, so the
server tokenizes them like any client's; lengths are in words of a small English list (about a
token each for an English-trained tokenizer; the real prompt token counts come back in usage).

What it shows: with several data-parallel replicas, whether a conversation's next turn finds
its prefix cached (the prefix hit rate from /metrics) and what that does to TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from pagedserve.bench.report import RequestRecord

WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "with",
         "as", "we", "you", "they", "this", "be", "at", "one", "have", "from", "or", "by", "but",
         "not", "what", "all", "were", "when", "can", "there", "an", "which", "time", "cache",
         "block", "model", "token", "day", "water", "light", "house", "story", "river", "small")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--dataset multi-turn")
    g.add_argument("--num-conversations", type=int, default=16)
    g.add_argument("--num-turns", type=int, default=6)
    g.add_argument("--system-prompt-len", type=int, default=256,
                   help="words of the system prompt every conversation shares (0: none)")
    g.add_argument("--turn-len", type=int, default=32, help="words of each new user message")
    # A person reads the answer and types before the next turn. With no pause, the replica that
    # just finished a turn is also the least loaded one, so least-loaded routing keeps each
    # conversation on its replica by accident and the benchmark hides what routing is for.
    g.add_argument("--think-time", type=float, default=1.0,
                   help="mean seconds (exponential) a user takes before each turn, the first included; "
                        "0: each turn goes as soon as the previous answer arrives")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation_records(ns: argparse.Namespace) -> list[RequestRecord]:
    return [RequestRecord(c * ns.num_turns + t, -1, ns.output_len)
            for c in range(ns.num_conversations) for t in range(ns.num_turns)]


async def run_conversations(ns: argparse.Namespace, records: list[RequestRecord], send) -> None:
    """``send(record, prompt, max_tokens) -> answer text`` for each turn, conversations in parallel."""
    system = _words(random.Random(ns.seed), ns.system_prompt_len) if ns.system_prompt_len else ""

    async def conversation(c: int) -> None:
        rng = random.Random(ns.seed * 7919 + c + 1)
        pace = random.Random(ns.seed * 104729 + c + 1)
        history = system
        for t in range(ns.num_turns):
            if ns.think_time > 0:  # its own generator, so the text is the same at any think time
                await asyncio.sleep(pace.expovariate(1.0 / ns.think_time))
            history += f"\nUser: {_words(rng, ns.turn_len)}\nAssistant:"
            answer = await send(records[c * ns.num_turns + t], history, ns.output_len)
            if answer is None:  # the turn failed: a real client would stop here too
                return
            history += answer

    await asyncio.gather(*(conversation(c) for c in range(ns.num_conversations)))
