"""``pagedserve bench lora``: many adapters of one base model against the base model alone, over
HTTP with the openai client, and against vLLM's server with ``--enable-lora`` when its venv is given.

Each engine serves the same random model (``--shape``, default 0.5b-bf16) twice, one server at a
time: once plain, every request to the base model, and once with ``--enable-lora --max-loras N
--lora-modules ...``, the requests spread round-robin over ``--num-adapters`` adapters of rank
``--rank`` on all seven projections (made once with peft, ``tools/lora_adapters.py``). The same
token-id prompts, ``ignore_eos``, ``--streams`` in flight, ``--runs`` runs alternating the servers.
Then, on pagedserve's LoRA server (runtime loading on), the first request of an adapter loaded just
before it (``POST /v1/load_lora_adapter``) against a request of a resident one, both on an idle
server: the TTFT an adapter's first user sees.

    pagedserve bench lora                       # 0.5b-bf16, 8 adapters of rank 16, 32 streams
    pagedserve bench lora --engines pagedserve,vllm --vllm-python /path/to/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.bench.peer import drive, make_prompts
from pagedserve.bench.report import cpu_label, median_spread
from pagedserve.bench.servers import (VLLM_START_TIMEOUT_S, BenchServer, parse_engines,
                                      pagedserve_command, resolve_vllm_python, vllm_command, vllm_env)
from pagedserve.bench.shapes import SHAPES, ensure_shape_model, shape_cache_dir

GOALS = {"lora_over_base": 0.8, "over_vllm": 1.5, "cold_over_resident_ttft": 2.0}  # issue 55
RUNTIME_ENV = {"PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="0.5b-bf16", choices=sorted(SHAPES))
    p.add_argument("--engines", default="pagedserve", help="comma-separated: pagedserve, vllm")
    p.add_argument("--vllm-python", help="the python of vLLM's own venv (default: $PAGEDSERVE_VLLM_PYTHON)")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold-tries", type=int, default=3, help="adapters loaded at run time for the TTFT check")
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` options (both servers)")


def ensure_adapters(model: str, shape: str, count: int, rank: int) -> list[str]:
    from pagedserve.tools.lora_adapters import make_adapters

    root = shape_cache_dir() / f"{shape}-lora-r{rank}"
    dirs = [root / f"a{i}" for i in range(count)]
    missing = [str(d) for d in dirs if not (d / "adapter_model.safetensors").exists()]
    if missing:
        print(f"making {len(missing)} adapters of rank {rank} with peft into {root} (once)", flush=True)
        # B scaled so the adapters' deltas are a few percent of the base projections, as trained ones are
        make_adapters(model, missing, r=rank, alpha=2 * rank, seeds=[hash(m) % 2**31 for m in missing], scale=0.05)
    return [str(d) for d in dirs]


def _lora_args(adapters: list[str], rank: int) -> list[str]:
    return ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(rank),
            "--lora-modules", *(f"a{i}={path}" for i, path in enumerate(adapters))]


def _servers(ns, model: str, adapters: list[str]) -> dict:
    extra = tuple(ns.pagedserve_args.split())
    lora = tuple(_lora_args(adapters, ns.rank))
    return {
        ("pagedserve", "base"): dict(command=lambda port: pagedserve_command(model, port, extra)),
        ("pagedserve", "lora"): dict(command=lambda port: pagedserve_command(model, port, extra + lora),
                                     env={**os.environ, **RUNTIME_ENV}),
        ("vllm", "base"): dict(command=lambda port: vllm_command(ns.vllm_python, model, port),
                               env=vllm_env(), timeout_s=VLLM_START_TIMEOUT_S),
        ("vllm", "lora"): dict(command=lambda port: vllm_command(ns.vllm_python, model, port) + list(lora),
                               env={**vllm_env(), **RUNTIME_ENV}, timeout_s=VLLM_START_TIMEOUT_S),
    }


async def _ttft(url: str, model: str, prompt: list[int]) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sent = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    first = None
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - sent
    await client.close()
    return first


def cold_vs_resident(url: str, prompts: list, adapters: list[str], tries: int, rank: int, shape: str,
                     model: str) -> tuple[list[float], list[float]]:
    """TTFT of a resident adapter's request, then of a just-loaded adapter's first, ``tries`` times."""
    import httpx

    extra = ensure_adapters(model, shape, len(adapters) + tries, rank)[len(adapters):]
    resident, cold = [], []
    # One connection for the load calls, as an operator's client keeps: a new httpx client per call
    # spends 15-60 ms of its own (an SSL context, a connection) that the server never sees.
    with httpx.Client(timeout=600) as control:
        control.get(url + "/health").raise_for_status()
        for i, path in enumerate(extra):
            resident.append(asyncio.run(_ttft(url, "a0", prompts[i])))
            t0 = time.perf_counter()
            control.post(url + "/v1/load_lora_adapter",
                         json={"lora_name": f"cold{i}", "lora_path": path}).raise_for_status()
            load = time.perf_counter() - t0
            cold.append(load + asyncio.run(_ttft(url, f"cold{i}", prompts[i])))  # what its first user waits
    return resident, cold


def main(ns: argparse.Namespace) -> int:
    engines = parse_engines(ns.engines)
    ns.vllm_python = resolve_vllm_python(engines, ns.vllm_python)
    model = str(ensure_shape_model(SHAPES[ns.shape]))
    adapters = ensure_adapters(model, ns.shape, ns.num_adapters, ns.rank)
    prompts = make_prompts(model, ns.num_prompts, tuple(ns.input_len))
    warmup = make_prompts(model, ns.streams, tuple(ns.input_len), seed=1)
    names = [f"a{i % ns.num_adapters}" for i in range(ns.num_prompts)]
    print(f"{ns.shape}: {ns.num_prompts} prompts of {ns.input_len[0]}-{ns.input_len[1]} tokens, {ns.output_len} "
          f"output tokens, {ns.streams} streams; LoRA: {ns.num_adapters} adapters of rank {ns.rank} on all seven "
          f"projections, round-robin; {ns.runs} runs; {cpu_label()}")
    servers = _servers(ns, model, adapters)
    runs: dict[tuple[str, str], list[dict]] = {}
    cold: dict[str, list[float]] = {}
    print(f"{'engine':<12}{'mode':<8}{'tok/s':>9}{'TTFT p50':>10}{'TPOT':>9}{'failed':>8}")
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-lora-") as logs:
        for run in range(ns.runs):
            for engine in engines:
                for mode in ("base", "lora"):
                    with BenchServer(f"{engine}-{mode}", log_dir=logs, **servers[(engine, mode)]) as server:
                        models = names if mode == "lora" else None
                        warm = names[:len(warmup)] if mode == "lora" else None
                        asyncio.run(drive(server.url, engine, "", warmup, ns.output_len, ns.streams, models=warm))
                        r = asyncio.run(drive(server.url, engine, "", prompts, ns.output_len, ns.streams,
                                              models=models))
                        if r["failed"]:
                            print(f"--- {engine} {mode} log:\n{server.log_tail(2000)}\n---")
                        if engine == "pagedserve" and mode == "lora" and run == 0 and ns.cold_tries:
                            res, cld = cold_vs_resident(server.url, prompts, adapters, ns.cold_tries, ns.rank,
                                                        ns.shape, model)
                            cold.setdefault("resident", []).extend(res)
                            cold.setdefault("cold", []).extend(cld)
                    runs.setdefault((engine, mode), []).append(r)
                    print(f"{engine:<12}{mode:<8}{r['output_token_throughput']:9.1f}{1e3 * r['ttft_s']['p50']:10.1f}"
                          f"{1e3 * r['tpot_s']['mean']:9.1f}{r['failed']:8d}", flush=True)
                    for err in r["errors"][:3]:
                        print(f"  error: {err}")
    print(f"\nmedian (min-max) over {ns.runs} runs; {cpu_label()}")
    tok = {k: [r["output_token_throughput"] for r in rs] for k, rs in runs.items()}
    for (engine, mode), values in tok.items():
        ttft = [1e3 * r["ttft_s"]["p50"] for r in runs[(engine, mode)]]
        print(f"{engine:<12}{mode:<6} tok/s {median_spread(values)}, TTFT p50 {median_spread(ttft)} ms")
    for engine in engines:
        ratios = [a / b for a, b in zip(tok[(engine, "lora")], tok[(engine, "base")]) if b]
        print(f"{engine}: LoRA / base tok/s per run {', '.join(f'{x:.2f}x' for x in ratios)}, median "
              f"{statistics.median(ratios):.2f}x (goal >= {GOALS['lora_over_base']}x)")
    if "vllm" in engines and "pagedserve" in engines:
        ratios = [a / b for a, b in zip(tok[("pagedserve", "lora")], tok[("vllm", "lora")]) if b]
        print(f"pagedserve LoRA / vLLM LoRA tok/s: median {statistics.median(ratios or [0]):.2f}x "
              f"(goal >= {GOALS['over_vllm']}x)")
    if cold:
        res, cld = statistics.median(cold["resident"]), statistics.median(cold["cold"])
        print(f"first request TTFT: resident adapter {1e3 * res:.1f} ms, adapter loaded just before (load call "
              f"included) {1e3 * cld:.1f} ms: {cld / res:.2f}x (goal <= {GOALS['cold_over_resident_ttft']}x)")
    return 0 if all(r["failed"] == 0 for rs in runs.values() for r in rs) else 1
