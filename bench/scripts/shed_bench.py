"""What one 429 of --max-waiting-requests costs the frontend's event loop: the real app (FastAPI,
pydantic, the demo model's tokenizer, the router), called in-process over ASGI while every replica
is full, with the door (frontend_proc/early_shed.py) and without it (the refusal in
EngineClient.submit, as before). Prints µs per refused request, median of --runs.

    python bench/scripts/shed_bench.py --requests 2000 --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.deploy.cli import ensure_demo_model
from pagedserve.frontend_proc.app import build_app
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.client.router import Router
from pagedserve.frontend_proc.serving import Serving
from pagedserve.protocol.messages import SchedulerStats
from pagedserve.protocol.zmq_io import Endpoints, make_run_dir

LIMIT = 16
BODY = json.dumps({"model": "demo-model", "prompt": list(range(10, 42)), "max_tokens": 48, "temperature": 0.0,
                   "stream": True, "ignore_eos": True}).encode()


async def _refusals(app, n: int) -> float:
    """Seconds for ``n`` refusals, one after another (each as uvicorn calls the app)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(BODY)).encode())], "client": ("127.0.0.1", 1), "server": None}
    statuses = []

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    started = time.perf_counter()
    for _ in range(n):
        messages = [{"type": "http.request", "body": BODY, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client stays: no disconnect

        await app(dict(scope), receive, send)
    elapsed = time.perf_counter() - started
    assert set(statuses) == {429}, set(statuses)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--runs", type=int, default=5)
    ns = p.parse_args()
    model = ensure_demo_model()
    tokenizer = PromptTokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        endpoints = Endpoints(make_run_dir(tmp))

        async def measure() -> dict[str, float]:
            router = Router(1, timeout_s=3600.0)
            router.update(SchedulerStats(replica=0, state="ready", pid=1, num_running=16, num_waiting=LIMIT))
            engine = EngineClient(endpoints, router, LIMIT)
            metrics = FrontendMetrics(router, "demo-model")
            serving = Serving(["demo-model"], 4096, engine, tokenizer, metrics)
            app = build_app(serving, router, metrics, None)
            app.user_middleware.clear()  # the app without the door: the refusal in submit(), as before
            late = app.build_middleware_stack()
            door = build_app(serving, router, metrics, None).build_middleware_stack()
            out = {}
            for name, asgi in (("late", late), ("door", door)):
                await _refusals(asgi, 200)  # warm
                out[name] = statistics.median([1e6 * await _refusals(asgi, ns.requests) / ns.requests
                                               for _ in range(ns.runs)])
            await engine.close()
            return out

        out = asyncio.run(measure())
    print(f"µs per 429 in the frontend (median of {ns.runs} x {ns.requests}): "
          f"late path {out['late']:.1f}, door {out['door']:.1f} ({out['late'] / out['door']:.0f}x less)")


if __name__ == "__main__":
    main()
