"""``pagedserve bench scenario misaligned --http``: the misaligned scenario through the serving
path (HTTP frontend, scheduler and worker processes), warm.

A pagedserve server (its defaults plus ``--serve-args``) is started here on 127.0.0.1. After a
warm-up round, each of ``--rounds`` rounds streams one request alone, then the six together
(prompts of 7 to 130 tokens, ``--output-len`` tokens each, ``ignore_eos``): aggregate tok/s of
the six over one alone, end to end, per round, and the median; TPOT alone and of the six says
what one step costs with one request and with six; preemptions from ``/metrics`` over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from pagedserve.bench.report import RequestRecord
from pagedserve.bench.serve import _one_request, _parse_metrics, first_model, get_text, http_session
from pagedserve.bench.servers import BenchServer, pagedserve_command

HTTP_PROMPT_LENS = (7, 31, 55, 80, 105, 130)
ALONE = 3  # the one alone: the 80-token prompt


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, 500) for _ in range(n)] for n in HTTP_PROMPT_LENS]


async def _round(client, knobs, model: str, prompts, output_len: int) -> dict:
    t0 = time.perf_counter()
    alone = RequestRecord(0, len(prompts[ALONE]), output_len)
    await _one_request(client, knobs, model, prompts[ALONE], output_len, alone, t0)
    six = [RequestRecord(i, len(p), output_len) for i, p in enumerate(prompts)]
    t1 = time.perf_counter()
    await asyncio.gather(*(_one_request(client, knobs, model, p, output_len, r, t1) for p, r in zip(prompts, six)))
    wall = time.perf_counter() - t1
    for rec in (alone, *six):
        if rec.error or rec.output_tokens != output_len:
            raise RuntimeError(f"request failed: {rec.error or f'{rec.output_tokens} tokens'}")
    alone_tps = alone.output_tokens / alone.e2e
    aggregate = sum(r.output_tokens for r in six) / wall
    tpot = lambda r: (r.e2e - r.ttft) / (r.output_tokens - 1)  # noqa: E731
    return {"alone_tok_s": alone_tps, "aggregate_tok_s": aggregate, "speedup": aggregate / alone_tps,
            "alone_tpot_ms": 1e3 * tpot(alone), "six_tpot_ms": 1e3 * statistics.fmean(tpot(r) for r in six),
            "alone_ttft_ms": 1e3 * alone.ttft, "six_ttft_max_ms": 1e3 * max(r.ttft for r in six),
            "wall_s": wall}


async def _run(url: str, ns: argparse.Namespace) -> dict:
    knobs = argparse.Namespace(temperature=0.0)
    prompts = _prompts()
    async with http_session(url, len(prompts)) as client:
        model = await first_model(client)
        await _round(client, knobs, model, prompts, ns.output_len)  # warm-up, not counted
        before = _parse_metrics(await get_text(client, "/metrics"))
        rounds = [await _round(client, knobs, model, prompts, ns.output_len) for _ in range(ns.rounds)]
        await asyncio.sleep(0.6)  # preemptions reach /metrics with the scheduler's stats (every 0.5 s)
        after = _parse_metrics(await get_text(client, "/metrics"))
    return {"rounds": rounds, "preemptions": after.get("preemptions", 0) - before.get("preemptions", 0)}


def misaligned_http(ns: argparse.Namespace, model: str) -> dict:
    extra = tuple(ns.serve_args.split())
    with tempfile.TemporaryDirectory(prefix="pagedserve-misaligned-") as logs:
        with BenchServer("pagedserve", lambda port: pagedserve_command(model, port, extra), logs) as server:
            result = asyncio.run(_run(server.url, ns))
    rounds = result["rounds"]
    print(f"misaligned over HTTP: 6 requests, prompts {list(HTTP_PROMPT_LENS)} tokens, {ns.output_len} output "
          f"tokens each; one alone: the {HTTP_PROMPT_LENS[ALONE]}-token prompt; warm")
    print(f"{'round':<7}{'alone tok/s':>12}{'six tok/s':>11}{'ratio':>8}{'TPOT 1':>9}{'TPOT 6':>9}"
          f"{'TTFT 1':>9}{'TTFT 6 max':>11}")
    for i, r in enumerate(rounds):
        print(f"{i:<7}{r['alone_tok_s']:12.1f}{r['aggregate_tok_s']:11.1f}{r['speedup']:7.2f}x"
              f"{r['alone_tpot_ms']:9.2f}{r['six_tpot_ms']:9.2f}{r['alone_ttft_ms']:9.1f}{r['six_ttft_max_ms']:11.1f}")
    speedups = [r["speedup"] for r in rounds]
    result.update(scenario="misaligned-http", prompt_lens=list(HTTP_PROMPT_LENS), output_len=ns.output_len,
                  speedup=statistics.median(speedups),
                  tpot_ratio=statistics.median(r["six_tpot_ms"] / r["alone_tpot_ms"] for r in rounds))
    print(f"aggregate / one alone: median {result['speedup']:.2f}x ({min(speedups):.2f}-{max(speedups):.2f}) "
          f"(goal >= 4x); step cost six / one (TPOT): median {result['tpot_ratio']:.2f}x")
    print(f"preemptions {result['preemptions']:.0f} (goal 0)")
    return result
