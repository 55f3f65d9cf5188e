"""``pagedserve bench serve``: drive a running server through its OpenAI API and measure it.

Requests are streamed completions (``/v1/completions``, ``stream=True``): random token-id
prompts of lengths uniform in a range, or the prompts of a JSONL file (``{"prompt": ...,
"max_tokens": ...}`` per line). They arrive as a Poisson process at ``--request-rate``
(default: all at once), at most ``--max-concurrency`` in flight; or ``--dataset multi-turn``
(multi_turn.py): conversations whose turns each wait for the previous answer. Reports TTFT, TPOT, ITL
(between events with choices, as vLLM's benchmark: the server sends one per token, with
empty text while a character or a possible stop string is incomplete) and end-to-end latency
(mean, p50, p90, p99), throughput, the worker's idle share, the prefix-cache hit rate and the
router's decisions (from /metrics, over the run); writes a JSON result and a
PNG (latency per request in arrival order; KV usage, running and waiting from /metrics).

The client is aiohttp, as vLLM's own serving benchmark: on a machine where the client shares
the server's cores, what it spends per event is taken from the server, and a client that falls
behind reads several events at once (ITL near zero). At 64 streams on 2 cores httpx spent
68-76 us of CPU per event and read in bursts (ITL p50 0.01 ms); aiohttp 24-25 us, with an
ITL p50 of 2.7 ms that matches the server's steps (bench/log/2026-11-25.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from dataclasses import asdict
from typing import Optional

import msgspec

from pagedserve.bench import multi_turn as bench_multi_turn
from pagedserve.bench.report import RequestRecord, cache_table, latency_table, plot_run, summarize


class _Usage(msgspec.Struct):
    completion_tokens: int = 0
    prompt_tokens: int = -1


class _Choice(msgspec.Struct):
    text: str = ""


class _Chunk(msgspec.Struct):
    """The fields of a stream event the bench reads: the client shares the server's cores,
    and decoding only these (msgspec, raw bytes split here) keeps it from falling behind
    and reading several events at once, which would show up as ITL near zero."""

    choices: list[_Choice] = []
    usage: Optional[_Usage] = None


_CHUNK = msgspec.json.Decoder(_Chunk)
_JSON = msgspec.json.Encoder()
_JSON_HEADERS = {"content-type": "application/json"}


def http_session(url: str, concurrency: int, api_key: Optional[str] = None):
    """One aiohttp session for the run: keep-alive connections, enough for every request in flight."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(base_url=url, headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                 connector=aiohttp.TCPConnector(limit=concurrency + 2))


async def get_text(client, path: str) -> str:
    async with client.get(path) as resp:
        return await resp.text()


async def first_model(client) -> str:
    async with client.get("/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dataset", help="JSONL of {prompt, max_tokens?}, replacing the random prompts; or "
                                     "'multi-turn' for chat-like conversations (options below)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    p.add_argument("--output-json", default="bench/out/bench-serve.json")
    p.add_argument("--output-png", default="bench/out/bench-serve.png")
    p.add_argument("--no-progress", action="store_true")
    bench_multi_turn.add_args(p)


def load_workload(ns: argparse.Namespace) -> list[tuple[object, int]]:
    """(prompt, max_tokens) per request; a prompt is a string or a list of token ids."""
    if ns.dataset:
        out = []
        with open(ns.dataset) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    out.append((row["prompt"], int(row.get("max_tokens", ns.output_len))))
        return out[: ns.num_prompts] if ns.num_prompts else out
    rng = random.Random(ns.seed)
    return [([rng.randrange(10, 500) for _ in range(rng.randint(*ns.input_len))], ns.output_len)
            for _ in range(ns.num_prompts)]


async def _one_request(client, ns, model: str, prompt, max_tokens: int, rec: RequestRecord,
                       t0: float) -> "str | None":
    """Streams one completion into ``rec``; its text, or None when it failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": ns.temperature,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec.start = time.perf_counter() - t0
    sent = time.perf_counter()
    last = sent
    pieces = []
    try:
        async with client.post("/v1/completions", data=_JSON.encode(body), headers=_JSON_HEADERS) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            pending = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()  # when this read's events reached the client
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue  # [DONE], comments
                    chunk = _CHUNK.decode(event[6:])
                    if chunk.usage is not None:
                        rec.output_tokens = chunk.usage.completion_tokens
                        rec.prompt_tokens = chunk.usage.prompt_tokens
                    if not chunk.choices:
                        continue  # the usage chunk; an event with empty text still carries a token
                    pieces.append(chunk.choices[0].text)
                    last = rec.token_event(sent, last, now)
        rec.e2e = time.perf_counter() - sent
        return "".join(pieces)
    except Exception as exc:  # a failed request is reported, not fatal to the run
        rec.error = f"{type(exc).__name__}: {exc}"
    return None


def _parse_metrics(text: str) -> dict[str, float]:
    wanted = {"pagedserve_kv_cache_usage_ratio": "kv_usage", "pagedserve_num_requests_running": "running",
              "pagedserve_num_requests_waiting": "waiting", "pagedserve_num_requests_swapped": "swapped",
              "pagedserve_num_preemptions_total": "preemptions",
              "pagedserve_worker_forward_seconds_total": "worker_forward_s",
              "pagedserve_worker_idle_seconds_total": "worker_idle_s"}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.partition("{")[0]  # every series carries a model_name label
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


_TTFT_BUCKET = "pagedserve_time_to_first_token_seconds_bucket{"


def ttft_histogram(text: str) -> dict[float, float]:
    """The server's TTFT histogram in a /metrics text: cumulative count per upper bound."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(_TTFT_BUCKET):
            labels, _, value = line.rpartition(" ")
            out[float(labels.partition('le="')[2].partition('"')[0])] = float(value)  # "+Inf" parses
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> Optional[float]:
    """The ``q`` quantile of what was observed between two scrapes of a histogram, as
    Prometheus's histogram_quantile reads it: linear inside the bucket it falls in."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank and count > below:
            if bound == float("inf"):
                return lower  # past the last finite bound: all it can say
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _cache_counters(text: str) -> dict[str, float]:
    """Prefix-cache and router counters (labelled ones keyed with their labels), to diff over a run."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("pagedserve_prefix_cache_", "pagedserve_router_")) and "_created" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _scrape(client, ns, t0: float, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            samples.append({"t": time.perf_counter() - t0, **_parse_metrics(await get_text(client, "/metrics"))})
        except Exception:
            pass  # a missed scrape is a gap in the plot, nothing more
        try:
            await asyncio.wait_for(stop.wait(), ns.metrics_interval)
        except asyncio.TimeoutError:
            pass


async def run_bench(ns: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    concurrency = ns.max_concurrency or (ns.num_conversations if ns.dataset == "multi-turn" else ns.num_prompts) or 1
    async with http_session(ns.url, concurrency, ns.api_key) as client:
        model = ns.model or await first_model(client)
        multi_turn = ns.dataset == "multi-turn"
        workload = [] if multi_turn else load_workload(ns)
        records = (bench_multi_turn.conversation_records(ns) if multi_turn else
                   [RequestRecord(i, len(p) if isinstance(p, list) else -1, n) for i, (p, n) in enumerate(workload)])
        samples: list[dict] = []
        stop = asyncio.Event()
        text = await get_text(client, "/metrics")
        before, cache_before, ttft_before = _parse_metrics(text), _cache_counters(text), ttft_histogram(text)
        gate = asyncio.Semaphore(ns.max_concurrency or len(records) or 1)
        bar = tqdm(total=len(records), desc="bench serve", unit="req", disable=ns.no_progress)
        rng = random.Random(ns.seed + 1)
        t0 = time.perf_counter()
        scraper = asyncio.create_task(_scrape(client, ns, t0, samples, stop))

        async def limited(rec: RequestRecord, prompt, max_tokens: int):
            async with gate:
                text = await _one_request(client, ns, model, prompt, max_tokens, rec, t0)
            bar.update(1)
            return text

        if multi_turn:
            await bench_multi_turn.run_conversations(ns, records, limited)
        tasks = []
        for rec, (prompt, max_tokens) in zip(records, workload):
            tasks.append(asyncio.create_task(limited(rec, prompt, max_tokens)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        await scraper
        bar.close()
        text = await get_text(client, "/metrics")
        after, cache_after, ttft_after = _parse_metrics(text), _cache_counters(text), ttft_histogram(text)
        for _ in range(10):  # the worker counters come with the scheduler's next stats (<= 0.5 s)
            await asyncio.sleep(0.1)
            latest = _parse_metrics(await get_text(client, "/metrics"))
            if latest.get("worker_forward_s") != after.get("worker_forward_s"):
                after = latest
                break
    result = summarize(records, duration)
    result["preemptions"] = after.get("preemptions", 0) - before.get("preemptions", 0)
    result["server_ttft_p50_s"] = histogram_quantile(ttft_before, ttft_after, 0.5)
    result["cache"] = cache = {k: v - cache_before.get(k, 0.0) for k, v in cache_after.items()}
    # Hits as each finished request reported them (exact at once; the scheduler counters in
    # /metrics lag by a stats interval), over the prompt tokens of the same requests.
    hits = sum(v for k, v in cache.items() if k.startswith("pagedserve_router_actual_hit_tokens_total"))
    prompt_tokens = sum(max(r.prompt_tokens, 0) for r in records if r.error is None)
    result["prefix_hit_rate"] = hits / prompt_tokens if prompt_tokens else 0.0
    forward = after.get("worker_forward_s", 0.0) - before.get("worker_forward_s", 0.0)
    idle = after.get("worker_idle_s", 0.0) - before.get("worker_idle_s", 0.0)
    if forward + idle > 0:  # the counters arrive with the scheduler's stats, every 0.5 s
        result["worker_idle_pct"] = 100 * idle / (forward + idle)
    result["config"] = {k: v for k, v in vars(ns).items() if k not in ("run", "api_key")}
    result["config"]["request_rate"] = str(ns.request_rate)
    result["requests"] = [asdict(r) for r in records]
    result["metrics_samples"] = samples
    return result


def main(ns: argparse.Namespace) -> int:
    result = asyncio.run(run_bench(ns))
    print(latency_table(result))
    print(cache_table(result))
    Path(ns.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.output_png).parent.mkdir(parents=True, exist_ok=True)
    with open(ns.output_json, "w") as f:
        json.dump(result, f, indent=1)
    plot_run(result, ns.output_png, title=f"bench serve: {ns.url}")
    print(f"wrote {ns.output_json} and {ns.output_png}")
    return 0 if result["failed"] == 0 else 1
