"""What grammar-constrained output costs: throughput of 64 concurrent requests, a quarter of
them ``json_schema``, against the same load unconstrained, on one server in one run.

    python bench/scripts/structured_output_bench.py [--model DIR] [--rounds 3] [--device cpu]

Starts ``pagedserve serve`` (the demo model unless ``--model``), then alternates rounds of the
two loads (so drift on a shared machine hits both alike): 64 streamed-less completions of
random-token prompts at temperature 1, ``max_tokens`` 64 with ``ignore_eos`` for the
unconstrained ones; in the mixed load every fourth request instead asks for a bounded JSON
schema (``response_format``-equivalent ``structured_outputs``), which ends when the object
closes. Throughput is generated tokens per second of wall time per round; the table gives
each round and the median ratio mixed / unconstrained, and tokens per scheduler step (steps
from ``/metrics``), which a loaded machine's noise does not move. The schedulers'
mask-filling time comes from ``/metrics`` too.

``--thinking`` serves the demo model with a thinking template (``</think>`` one token) under
``--reasoning-parser qwen3`` and sends chat requests instead, the constrained ones with
``response_format``: their grammar waits for the end of a thinking the random model seldom
closes, so this measures what a constrained request costs while it thinks (it is handled as a
constrained one throughout: no decode lane, no step ahead), both loads running ``max_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedserve.deploy.entry_points import python_module

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "maxItems": 4},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 8}},
                 "required": ["ok", "note"], "additionalProperties": False},
    },
    "required": ["id", "name", "kind", "scores", "meta"],
    "additionalProperties": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = python_module("pagedserve.deploy.cli", "serve", model, "--port", str(port), *extra)
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling readiness
    proc.send_signal(signal.SIGTERM)
    raise RuntimeError("server not healthy after 300 s")


async def one(client: httpx.AsyncClient, body: dict) -> int:
    r = await client.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text}")
    return r.json()["usage"]["completion_tokens"]


def bodies(num: int, constrained_every: int, rng: random.Random, max_tokens: int, thinking: bool = False) -> list[dict]:
    if thinking:
        return [{"messages": [{"role": "user", "content": f"Question {rng.randrange(10**6)}: what is {i} + {i}?"}],
                 "temperature": 1.0, "seed": rng.randrange(1 << 30), "max_tokens": max_tokens, "ignore_eos": True,
                 **({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
                    if constrained_every and i % constrained_every == 0 else {})} for i in range(num)]
    out = []
    for i in range(num):
        body = {"prompt": [rng.randrange(10, 500) for _ in range(rng.randrange(16, 64))], "temperature": 1.0,
                "seed": rng.randrange(1 << 30)}
        if constrained_every and i % constrained_every == 0:
            body.update(max_tokens=400, structured_outputs={"json": SCHEMA})
        else:
            body.update(max_tokens=max_tokens, ignore_eos=True)
        out.append(body)
    return out


async def run_round(url: str, load: list[dict]) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(load), max_keepalive_connections=len(load))
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, body) for body in load))
        return time.perf_counter() - t0, sum(tokens)


def counters(url: str) -> tuple[float, float]:
    """(scheduler steps, seconds spent filling masks) so far, from /metrics; the schedulers'
    stats arrive with their heartbeat, so this waits one out."""
    time.sleep(1.0)  # a stats heartbeat is 0.5 s: the counters cover the round just run
    text = httpx.get(url + "/metrics", timeout=30).text

    def read(name: str) -> float:
        match = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0
    return read("pagedserve_scheduler_steps_total"), read("pagedserve_structured_output_mask_seconds_total")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the demo model, built in a temp dir)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-args", default="--max-num-seqs 64", help="extra `pagedserve serve` flags")
    p.add_argument("--thinking", action="store_true", help="chat with --reasoning-parser qwen3 (see above)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedserve-so-bench-") as tmp:
        model = ns.model
        if model is None and ns.thinking:
            from pagedserve.tools.demo_model import build_model_dir

            model = str(build_model_dir(Path(tmp) / "demo", "qwen2", hidden_size=128, num_heads=4, num_kv_heads=2,
                                        intermediate_size=256, vocab_size=1024, max_position_embeddings=4096,
                                        seed=1234, thinking_template=True))  # the demo model's shape
        elif model is None:
            from pagedserve.tools.demo_model import build_demo_model

            model = str(build_demo_model(Path(tmp) / "demo"))
        port = free_port()
        extra = ns.serve_args.split() + (["--reasoning-parser", "qwen3"] if ns.thinking else [])
        proc = start_server(model, port, extra, Path(tmp) / "server.log")
        url = f"http://127.0.0.1:{port}"
        try:
            rng = random.Random(0)
            asyncio.run(run_round(url, bodies(8, 4, rng, 8, ns.thinking)))  # warm-up: compiles the schema once
            rows = []
            for r in range(ns.rounds):
                for name, every in (("unconstrained", 0), ("1/4 json_schema", 4)):
                    steps0, mask0 = counters(url)
                    load = bodies(ns.num_requests, every, random.Random(100 + r), ns.max_tokens, ns.thinking)
                    seconds, tokens = asyncio.run(run_round(url, load))
                    steps1, mask1 = counters(url)
                    rows.append((r, name, tokens, seconds, tokens / seconds, steps1 - steps0, mask1 - mask0))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"{ns.num_requests} concurrent completions per round, model {ns.model or 'demo'}, "
          f"serve args {ns.serve_args!r}{', thinking' if ns.thinking else ''}, {os.cpu_count()} CPUs")
    print(f"{'round':>5} {'load':<16} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'steps':>6} {'tok/step':>8} "
          f"{'mask s':>7}")
    for r, name, tokens, seconds, rate, steps, mask in rows:
        print(f"{r:>5} {name:<16} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {steps:>6.0f} {tokens / max(steps, 1):>8.1f} "
              f"{mask:>7.3f}")
    ratios = [rows[i + 1][4] / rows[i][4] for i in range(0, len(rows), 2)]
    per_step = [(rows[i + 1][2] / rows[i + 1][5]) / (rows[i][2] / rows[i][5]) for i in range(0, len(rows), 2)]
    print(f"throughput mixed / unconstrained: median {statistics.median(ratios):.1%} "
          f"(rounds: {', '.join(f'{x:.1%}' for x in ratios)}); goal >= 80%")
    print(f"tokens per step mixed / unconstrained: median {statistics.median(per_step):.1%} "
          f"(rounds: {', '.join(f'{x:.1%}' for x in per_step)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
