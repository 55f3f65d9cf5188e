"""``pagedserve bench peer``: pagedserve, vLLM's OpenAI server, llama.cpp's ``llama-server``
and ``transformers serve --continuous-batching`` side by side (``--engines``, any subset, in turn
order), over HTTP, with the official ``openai`` client.

llama.cpp is built here from the llama-cpp-python sdist's source and serves the same weights
converted by its own converter (``--llamacpp-type``: bf16, f32, q8_0, or a ``llama-quantize``
type such as q4_k_m; ``llamacpp.py``), with a slot per stream. ``--max-concurrency 1,4,16`` runs
the workload at each concurrency in turn, each engine in each.

One random 3-layer Llama (written once to the bench-model cache; ``--model`` or ``--shape``
for another), each server started here on 127.0.0.1 with its defaults (transformers on the
CPU; vLLM from the interpreter of its own environment, ``--vllm-python``, offline, with
``--vllm-memory-utilization`` of the RAM), one at a time, each warmed up, then the same
workload against each in turn, ``--runs`` times, alternating so that load from other work on
the machine falls on all: ``--num-prompts`` streamed completions, at most ``--max-concurrency`` in flight,
``--output-len`` tokens each. Prompts are text (transformers serve takes no token ids): random
token ids of lengths uniform in ``--input-len``, sent as token ids to every engine but
transformers, which takes text only: with it among the engines every engine gets them decoded. Every request generates exactly ``--output-len`` tokens: pagedserve and vLLM
are asked ``ignore_eos``, transformers gets a ``generation_config`` without an EOS (its own field).
TTFT, TPOT and ITL are measured as ``bench serve`` measures them, from the stream's events.
Servers are stopped on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import tempfile
import time
from typing import Optional
from pathlib import Path

from pagedserve.bench import llamacpp
from pagedserve.bench.report import RequestRecord, cpu_label, median_spread, summarize
from pagedserve.bench.serve import _parse_metrics, histogram_quantile, ttft_histogram
from pagedserve.bench.servers import (VLLM_MEMORY_UTILIZATION, VLLM_PYTHON_ENV, VLLM_START_TIMEOUT_S,
                                             BenchServer, add_sampling_args, bench_sampling, pagedserve_command,
                                             parse_engines, resolve_vllm_python, sampling_label, transformers_command,
                                             vllm_command, vllm_env)
from pagedserve.bench.shapes import SHAPES, BenchShape, ensure_shape_model, shape_cache_dir
from pagedserve.runtime.options import resolve_device

ENGINES = ("pagedserve", "transformers")  # the default turn order
LLAMA3 = BenchShape("llama-3layer", dict(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                                         intermediate_size=256, vocab_size=1024,
                                         max_position_embeddings=4096, seed=1234))
GOALS = {"ttft_p50_ms": 60.0, "tpot_mean_ms": 8.0}  # pagedserve's, on the 3-layer Llama
RATIO_GOALS = {"transformers": 6.0, "vllm": 1.5, "llamacpp": 1.0}  # pagedserve's output tok/s over the peer's (issue 31 for vLLM)
# Connections per openai client: one httpx pool of 512 spent ~4x the CPU of the whole server
# on 2 cores (its bookkeeping grows with the pool), so the streams are spread over several.
CONNECTIONS_PER_CLIENT = 32


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the random 3-layer Llama, written once)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a bench shape's random model instead (shapes.py)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated, in turn order: pagedserve, vllm, transformers, llamacpp")
    p.add_argument("--llamacpp-type", default="bf16",
                   help="the GGUF llama-server runs: a converter type (f32, f16, bf16, q8_0) or a "
                        "llama-quantize type (q4_k_m, q6_k, ...), from the same weights")
    p.add_argument("--pagedserve-gguf", action="store_true",
                   help="pagedserve serves llama-server's own GGUF file (--llamacpp-type) instead of the model "
                        "directory: the same bytes for both engines")
    p.add_argument("--pagedserve-model",
                   help="pagedserve serves this directory instead: its own checkpoint of the same weights (for "
                        "example quant_bench.py's W4A16 of the shape), against llama-server's --llamacpp-type file")
    p.add_argument("--vllm-python", help=f"the python of vLLM's own venv (default: ${VLLM_PYTHON_ENV})")
    p.add_argument("--vllm-memory-utilization", type=float, default=VLLM_MEMORY_UTILIZATION,
                   help="vLLM's --gpu-memory-utilization: on a CPU, the share of RAM it reserves")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="every server's --dtype (auto: each engine's own rule)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-concurrency", type=_concurrencies, default=[64],
                   help="streams in flight; a comma-separated list runs the workload at each (1,4,16)")
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=128)
    add_sampling_args(p)
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine, alternating engines")
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda, for both servers")
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` options, one shell-quoted string")
    p.add_argument("--output-json", help="write every run's summary here")


def ensure_llama_model() -> Path:
    from pagedserve.tools.demo_model import build_model_dir

    path = shape_cache_dir() / LLAMA3.name
    if not (path / "config.json").exists():
        print(f"writing the random 3-layer Llama to {path} (once)", flush=True)
        build_model_dir(path.with_name(LLAMA3.name + ".partial"), "llama", **LLAMA3.model)
        path.with_name(LLAMA3.name + ".partial").rename(path)
    return path


def _concurrencies(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return values


def make_prompts(model: str, num: int, input_len: tuple[int, int], seed: int = 0,
                 as_text: bool = False) -> list:
    """Random non-special token ids, lengths uniform in ``input_len``; decoded where ``as_text``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    prompts = [[rng.choice(ids) for _ in range(rng.randint(*input_len))] for _ in range(num)]
    return [tok.decode(p) for p in prompts] if as_text else prompts


def _request_body(engine: str, output_len: int, sampling: dict) -> dict:
    """The engine's fields beyond the openai client's: ignore_eos, and top_k when sampling asks."""
    if engine in ("pagedserve", "vllm", "llamacpp"):
        top_k = {"top_k": sampling["top_k"]} if sampling.get("top_k", 0) > 0 else {}
        return {"extra_body": {"ignore_eos": True, **top_k}}
    return {"extra_body": {"generation_config": json.dumps(
        {"max_new_tokens": output_len, "do_sample": False, "eos_token_id": -1})}}


async def _one(client, engine: str, model: str, prompt, output_len: int, rec: RequestRecord,
               sampling: dict) -> None:
    sent = last = time.perf_counter()
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len,
                                                 temperature=sampling.get("temperature", 0.0),
                                                 top_p=sampling.get("top_p", 1.0), stream=True,
                                                 stream_options={"include_usage": True},
                                                 **_request_body(engine, output_len, sampling))
        async for chunk in stream:
            if chunk.usage is not None:  # the last event (transformers sends usage unasked, with empty text)
                rec.output_tokens, rec.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                continue
            if not chunk.choices:
                continue
            # An event per token from pagedserve (empty text mid-character); transformers sends
            # text only, so a token that ends no character arrives with the next one's event.
            last = rec.token_event(sent, last, time.perf_counter())
        rec.e2e = time.perf_counter() - sent
        if rec.output_tokens != output_len:
            rec.error = f"{rec.output_tokens} tokens generated (usage), expected {output_len}"
    except Exception as exc:  # reported with the run, never fatal to it
        rec.error = f"{type(exc).__name__}: {exc}"


def _http_client():
    """The openai client's aiohttp transport (its `aiohttp` extra) where installed, else httpx.

    The client shares the servers' cores here; per stream event it spent 94 us of CPU over
    httpx and 71 us over aiohttp (bench/log/2026-11-25.md), time the server under test loses."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=CONNECTIONS_PER_CLIENT, max_keepalive_connections=CONNECTIONS_PER_CLIENT)
    try:
        import httpx_aiohttp  # noqa: F401  (what the client's `aiohttp` extra installs)
        return openai.DefaultAioHttpClient(limits=limits, timeout=None)
    except (ImportError, AttributeError):  # no extra, or an openai from before it
        return openai.DefaultAsyncHttpxClient(limits=limits, timeout=None)


async def drive(url: str, engine: str, model: str, prompts: list, output_len: int, concurrency: int,
                sampling: Optional[dict] = None, models: Optional[list[str]] = None) -> dict:
    """The workload against one server; ``summarize``'s result plus the pagedserve worker idle share.
    ``sampling``: temperature, top_p and top_k of every request (default greedy). ``models``: the
    model field of each prompt (LoRA adapters by name), else the server's first model for all."""
    sampling = sampling or {}
    import openai

    # The openai client's own default retries (2), as its users run it: llama-server's HTTP library closes a
    # kept-alive connection after a few requests, and a request sent on it as it closes failed outright with
    # retries off (1-2 of 32 in half the runs, bench/log/2026-12-07.md); no engine here answers 429 or 5xx.
    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2, http_client=_http_client())
               for _ in range(-(-concurrency // CONNECTIONS_PER_CLIENT))]
    if engine != "transformers" and models is None:  # transformers serve answers to its FORCE_MODEL argument
        model = (await clients[0].models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)
    records = [RequestRecord(i, -1, output_len) for i in range(len(prompts))]
    metrics = clients[0]._client  # the httpx client underneath, for /metrics (pagedserve only)

    async def scrape() -> tuple[dict, dict]:
        if engine != "pagedserve":
            return {}, {}
        text = (await metrics.get(url + "/metrics")).text
        return _parse_metrics(text), ttft_histogram(text)

    async def limited(rec: RequestRecord, prompt) -> None:
        async with gate:
            await _one(clients[rec.index % len(clients)], engine, model if models is None else models[rec.index],
                       prompt, output_len, rec, sampling)

    before, ttft_before = await scrape()
    t0 = time.perf_counter()
    await asyncio.gather(*(limited(rec, p) for rec, p in zip(records, prompts)))
    duration = time.perf_counter() - t0
    after, ttft_after = before, ttft_before
    for _ in range(10):  # the worker counters reach /metrics with the scheduler's stats (<= 0.5 s)
        await asyncio.sleep(0.1)
        after, ttft_after = await scrape()
        if after.get("worker_forward_s") != before.get("worker_forward_s"):
            break
    for c in clients:
        await c.close()
    result = summarize(records, duration)
    forward = after.get("worker_forward_s", 0.0) - before.get("worker_forward_s", 0.0)
    idle = after.get("worker_idle_s", 0.0) - before.get("worker_idle_s", 0.0)
    if forward + idle > 0:
        result["worker_idle_pct"] = 100 * idle / (forward + idle)
    result["preemptions"] = after.get("preemptions", 0) - before.get("preemptions", 0)
    result["server_ttft_p50_s"] = histogram_quantile(ttft_before, ttft_after, 0.5)
    return result


def _load() -> str:
    import os

    return "%.1f" % os.getloadavg()[0]


def _row(engine: str, r: dict) -> str:
    idle = f"{r['worker_idle_pct']:.1f}%" if "worker_idle_pct" in r else "-"
    server = r.get("server_ttft_p50_s")
    server = f"{1e3 * server:.1f}" if server is not None else "-"
    return (f"{engine:<14}{r['output_token_throughput']:10.1f}{1e3 * r['ttft_s']['p50']:10.1f}{server:>10}"
            f"{1e3 * r['tpot_s']['mean']:10.1f}{1e3 * r['itl_s']['p50']:10.1f}{r['failed']:8d}{idle:>8}{r['load']:>7}"
            f"{r['ready_s']:9.1f}")


def _servers(ns: argparse.Namespace, model: str, device: str, concurrency: int) -> dict:
    """Per engine, what BenchServer needs: the command for a port, and how it is started."""
    dtype = ("--dtype", ns.dtype) if ns.dtype != "auto" else ()
    slot = ns.input_len[1] + ns.output_len + 16  # llama-server splits its context over its slots
    ours = str(ns.gguf) if ns.pagedserve_gguf else ns.pagedserve_model or model
    return {"pagedserve": dict(command=lambda port: pagedserve_command(
                ours, port, ("--device", device, *dtype, *shlex.split(ns.pagedserve_args)))),
            "transformers": dict(command=lambda port: transformers_command(model, port, device, ns.dtype)),
            "vllm": dict(command=lambda port: vllm_command(ns.vllm_python, model, port, ns.dtype,
                                                           ns.vllm_memory_utilization),
                         env=vllm_env(), timeout_s=VLLM_START_TIMEOUT_S),
            "llamacpp": dict(command=lambda port: llamacpp.server_command(ns.gguf, port, concurrency, slot))}


def main(ns: argparse.Namespace) -> int:
    engines = parse_engines(ns.engines)
    if ns.pagedserve_gguf and ns.pagedserve_model:
        raise SystemExit("--pagedserve-gguf and --pagedserve-model each choose what pagedserve serves: give one")
    ns.vllm_python = resolve_vllm_python(engines, ns.vllm_python)
    sampling = bench_sampling(ns, engines)
    model = ns.model or str(ensure_shape_model(SHAPES[ns.shape]) if ns.shape else ensure_llama_model())
    device = resolve_device(ns.device)
    if ns.pagedserve_gguf and "llamacpp" not in engines:
        raise SystemExit("--pagedserve-gguf serves llama-server's file: add llamacpp to --engines")
    if "llamacpp" in engines:
        llamacpp.ensure_built()
        ns.gguf = llamacpp.ensure_gguf(model, ns.llamacpp_type)
    as_text = "transformers" in engines
    prompts = make_prompts(model, ns.num_prompts, tuple(ns.input_len), as_text=as_text)
    warmup = make_prompts(model, ns.warmup_prompts, tuple(ns.input_len), seed=1, as_text=as_text)
    label = {e: f"{e} {ns.llamacpp_type}" if e == "llamacpp" else e for e in engines}
    print(f"model {model}; {ns.num_prompts} prompts of {ns.input_len[0]}-{ns.input_len[1]} tokens "
          f"({'text' if as_text else 'token ids'}), {ns.output_len} output tokens, "
          f"{'/'.join(map(str, ns.max_concurrency))} concurrent, {ns.runs} runs per engine, "
          f"dtype {ns.dtype}, {device}, {sampling_label(sampling)}; {cpu_label()}")
    if ns.pagedserve_gguf or ns.pagedserve_model:
        print(f"pagedserve serves {ns.gguf if ns.pagedserve_gguf else ns.pagedserve_model}")
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-peer-") as logs:
        for concurrency in ns.max_concurrency:
            servers = _servers(ns, model, device, concurrency)
            print(f"\n{concurrency} concurrent\n{'engine':<20}{'tok/s':>10}{'TTFT p50':>10}{'server':>10}{'TPOT':>10}"
                  f"{'ITL p50':>10}{'failed':>8}{'idle':>8}{'load':>7}{'ready s':>9}")
            print("(server: TTFT p50 from pagedserve's own histogram, from the request's submission to the engine; "
                  "ready: launch to the first 200 on /health)")
            for _ in range(ns.runs):
                for engine in engines:  # one server at a time: the other's idle threads never share the cores
                    with BenchServer(engine, log_dir=logs, **servers[engine]) as server:
                        asyncio.run(drive(server.url, engine, model, warmup, ns.output_len, concurrency, sampling))
                        result = asyncio.run(drive(server.url, engine, model, prompts, ns.output_len, concurrency,
                                                   sampling))
                        if result["failed"]:  # say why, from the server's side, before its log goes
                            print(f"--- {engine} server log, last lines:\n{server.log_tail(2000)}\n---")
                    result["load"] = _load()
                    result["ready_s"] = server.ready_s
                    runs.setdefault((engine, concurrency), []).append(result)
                    print(_row(label[engine], result), flush=True)
                    for err in result["errors"]:
                        print(f"  error: {err}")
    print(f"\nmedian (min-max) over runs; {cpu_label()}")
    summary = {}
    for concurrency in ns.max_concurrency:
        for engine in engines:
            rs = runs[(engine, concurrency)]
            summary[(engine, concurrency)] = row = {
                "tok_s": [r["output_token_throughput"] for r in rs],
                "ttft_p50_ms": [1e3 * r["ttft_s"]["p50"] for r in rs],
                "tpot_mean_ms": [1e3 * r["tpot_s"]["mean"] for r in rs],
                "ready_s": [r["ready_s"] for r in rs]}
            print(f"{concurrency:>3} {label[engine]:<20} tok/s {median_spread(row['tok_s'])}, TTFT p50 "
                  f"{median_spread(row['ttft_p50_ms'])} ms, TPOT mean {median_spread(row['tpot_mean_ms'])} ms, "
                  f"ready {median_spread(row['ready_s'])} s")
        for peer in (e for e in engines if e != "pagedserve" and "pagedserve" in engines):
            ours, theirs = summary[("pagedserve", concurrency)], summary[(peer, concurrency)]
            ratios = [a / b for a, b in zip(ours["tok_s"], theirs["tok_s"]) if b]
            tpot = [a / b for a, b in zip(ours["tpot_mean_ms"], theirs["tpot_mean_ms"]) if b]
            print(f"{concurrency:>3} pagedserve / {label[peer]}: tok/s per run pair "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)}, median {statistics.median(ratios or [0]):.2f}x "
                  f"(goal >= {RATIO_GOALS[peer]:.1f}x); TPOT median {statistics.median(tpot or [0]):.2f}x")
    if "pagedserve" in engines and "transformers" in engines:
        print(f"pagedserve goals against transformers: TTFT p50 <= {GOALS['ttft_p50_ms']:.0f} ms, "
              f"TPOT mean <= {GOALS['tpot_mean_ms']:.0f} ms")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items() if k != "run"},
                       "cpu": cpu_label(), "runs": {f"{e}@{c}": rs for (e, c), rs in runs.items()}}, f, indent=1)
    return 0 if all(r["failed"] == 0 for rs in runs.values() for r in rs) else 1
