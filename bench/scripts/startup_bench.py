"""Time from launching a server to its first answer, pagedserve against `transformers serve`
and vLLM's OpenAI server.

    python bench/scripts/startup_bench.py [MODEL_DIR] [--runs 5] [--engines pagedserve,transformers,vllm]
        [--vllm-python PATH] [--dtype auto] [--start-methods forkserver,exec]

Each run starts the server cold (a new process group, this checkout's defaults), waits
for it to accept a one-token completion, and stops it; engines alternate run by run.
`ready` is the first 200 from the readiness path (pagedserve's and vLLM's /health,
transformers' /v1/models); `first answer` adds one `max_tokens=1` completion, which is where
transformers serve loads its model; `CPU-s` is what the server's processes had used when it
was ready. The default model is the bench's random 3-layer Llama. `--start-methods` runs
pagedserve once per ``PAGEDSERVE_START_METHOD`` (deploy/README.md, "No orphans"). Prints the
median and the spread of each per engine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import httpx
import psutil

from pagedserve.bench.peer import ensure_llama_model
from pagedserve.bench.report import cpu_label, median_spread
from pagedserve.bench.servers import (VLLM_START_TIMEOUT_S, BenchServer, pagedserve_command, parse_engines,
                                             resolve_vllm_python, transformers_command, vllm_command, vllm_env)
from pagedserve.runtime.options import resolve_device

READY_PATHS = {"pagedserve": "/health", "transformers": "/v1/models", "vllm": "/health"}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and every process under it."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_start(label: str, model: str, device: str, logs: str, ns: argparse.Namespace) -> tuple[float, float, float]:
    engine, _, start_method = label.partition("[")
    dtype = ("--dtype", ns.dtype) if ns.dtype != "auto" else ()
    commands = {"pagedserve": lambda port: pagedserve_command(model, port, ("--device", device, *dtype)),
                "transformers": lambda port: transformers_command(model, port, device, ns.dtype),
                "vllm": lambda port: vllm_command(ns.vllm_python, model, port, ns.dtype)}
    extra = dict(env=vllm_env(), timeout_s=VLLM_START_TIMEOUT_S) if engine == "vllm" else {}
    if start_method:
        extra["env"] = {**os.environ, "PAGEDSERVE_START_METHOD": start_method.rstrip("]")}
    started = time.monotonic()
    server = BenchServer(engine, commands[engine], logs, ready_path=READY_PATHS[engine], poll_s=0.05, **extra)
    with server:
        ready = time.monotonic() - started
        cpu_s = tree_cpu_s(server.proc.pid)
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"model": name, "prompt": "Hello", "max_tokens": 1})
        if reply.status_code != 200:
            raise RuntimeError(f"{engine}: {reply.status_code} {reply.text}")
        return ready, time.monotonic() - started, cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="model directory (default: the random 3-layer Llama)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--engines", default="pagedserve,transformers")
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda, for both servers")
    parser.add_argument("--dtype", default="auto", help="every server's --dtype")
    parser.add_argument("--vllm-python", help="the python of vLLM's own venv (default: $PAGEDSERVE_VLLM_PYTHON)")
    parser.add_argument("--start-methods", default="", help="pagedserve once per PAGEDSERVE_START_METHOD "
                        "given (forkserver, exec), comma-separated; default: as the environment says")
    ns = parser.parse_args()
    model = ns.model or str(ensure_llama_model())
    device = resolve_device(ns.device)
    engines = parse_engines(ns.engines)
    ns.vllm_python = resolve_vllm_python(engines, ns.vllm_python)
    methods = [m.strip() for m in ns.start_methods.split(",") if m.strip()]
    if methods:
        engines = [label for e in engines for label in ([f"{e}[{m}]" for m in methods] if e == "pagedserve" else [e])]
    print(f"model {model}, dtype {ns.dtype}, {device}; {cpu_label()}")
    times: dict[str, list[tuple[float, float, float]]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as logs:
        for run in range(ns.runs):
            for engine in engines:
                times[engine].append(one_start(engine, model, device, logs, ns))
                ready, first, cpu_s = times[engine][-1]
                print(f"run {run + 1} {engine:22s} ready {ready:6.2f} s, first answer {first:6.2f} s, "
                      f"{cpu_s:5.1f} CPU-s", flush=True)
    print(f"\n{'engine':22s} {'ready s, median (range)':>26s} {'first answer s':>26s} {'CPU-s at ready':>22s}")
    for engine in engines:
        print(f"{engine:22s} {median_spread([t[0] for t in times[engine]], 2):>26s} "
              f"{median_spread([t[1] for t in times[engine]], 2):>26s} "
              f"{median_spread([t[2] for t in times[engine]], 1):>22s}")


if __name__ == "__main__":
    main()
