"""Embedding throughput against prefill throughput on the same prompts: ``/v1/embeddings`` on a
``--task embed`` deployment, and ``/v1/completions`` with ``max_tokens=1`` on a generating one.

    python bench/scripts/embed_bench.py [MODEL_DIR] [--requests 256] [--prompt-len 128]
        [--concurrency 32] [--rounds 3] [--pooling-type last|mean] [--extra-args "..."]

Both deployments run this checkout's defaults on the same model (default: the demo model), one
at a time. Every prompt is random token ids (seeded, the same for both), one request each, sent
with ``--concurrency`` in flight; each round is timed from the first send to the last answer,
after one warm-up round. Prints the median prompt tokens per second of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from pagedserve.bench.report import cpu_label
from pagedserve.bench.servers import BenchServer, pagedserve_command
from pagedserve.deploy.cli import ensure_demo_model


async def _round(url: str, path: str, bodies: list[dict], concurrency: int) -> float:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one(body: dict) -> None:
            async with limit:
                response = await c.post(path, json=body)
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - started


def measure(model: str, extra: tuple[str, ...], path: str, bodies: list[dict], ns, logs: str) -> list[float]:
    """Seconds per timed round on a fresh deployment started with ``extra``."""
    with BenchServer(path.rsplit("/", 1)[-1], lambda port: pagedserve_command(model, port, extra), logs) as server:
        asyncio.run(_round(server.url, path, bodies[: ns.concurrency], ns.concurrency))  # warm-up
        return [asyncio.run(_round(server.url, path, bodies, ns.concurrency)) for _ in range(ns.rounds)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="model directory (default: the demo model)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pooling-type", choices=("last", "mean"), default="last")
    p.add_argument("--extra-args", default="--device cpu", help="serve flags both deployments get")
    ns = p.parse_args()
    model = ns.model or str(ensure_demo_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, ns.prompt_len).tolist() for _ in range(ns.requests)]
    extra = tuple(shlex.split(ns.extra_args))
    tokens = ns.requests * ns.prompt_len
    with tempfile.TemporaryDirectory() as logs:
        embed = measure(model, (*extra, "--task", "embed", "--pooling-type", ns.pooling_type), "/v1/embeddings",
                        [{"input": ids} for ids in prompts], ns, logs)
        prefill = measure(model, extra, "/v1/completions",
                          [{"prompt": ids, "max_tokens": 1} for ids in prompts], ns, logs)
    print(f"# {cpu_label()}")
    print(f"# {ns.requests} requests x {ns.prompt_len} prompt tokens, concurrency {ns.concurrency}, "
          f"{ns.rounds} rounds (median), pooling {ns.pooling_type}, serve flags: {ns.extra_args}")
    print(f"{'endpoint':<38} {'s/round':>9} {'prompt tok/s':>13}")
    rates = {}
    for name, seconds in (("/v1/embeddings (--task embed)", embed), ("/v1/completions max_tokens=1", prefill)):
        median = statistics.median(seconds)
        rates[name] = tokens / median
        spread = f"{min(seconds):.2f}-{max(seconds):.2f}"
        print(f"{name:<38} {median:>9.2f} {rates[name]:>13.0f}   (rounds {spread} s)")
    embed_rate, prefill_rate = rates.values()
    print(f"embeddings / prefill: {embed_rate / prefill_rate:.3f}")


if __name__ == "__main__":
    main()
