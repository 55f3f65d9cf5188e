"""Entry point: python -m pagedserve.frontend_proc --run-dir DIR --model DIR ...

Starts the HTTP server and, once it is accepting connections, tells the supervisor
with a ProcessReady(role="frontend").
"""

from __future__ import annotations

from pagedserve.clean_path import drop_working_directory

drop_working_directory()  # before anything imports transformers (pagedserve/clean_path.py)

from pagedserve.call_trace import record_on_signal  # noqa: E402

record_on_signal("frontend")  # tools/request_path.py; off by default

import asyncio
import gc
import logging
import os
import sys
from typing import Optional, Sequence

import uvicorn
import zmq

from pagedserve.frontend_proc.app import build_app
from pagedserve.frontend_proc.args import FrontendConfig, parse_args
from pagedserve.frontend_proc.drain import DRAIN_GRACE_S, DrainingServer, end_requests_at_drain_deadline
from pagedserve.frontend_proc.embeddings_api import EmbeddingServing
from pagedserve.frontend_proc.engine_client import EngineClient
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.frontend_proc.reasoning import get_reasoning_parser
from pagedserve.client.router import Router
from pagedserve.frontend_proc.serving import Serving
from pagedserve.client.generation_defaults import load_generation_defaults
from pagedserve.client.lora_adapters import AdapterNameError, AdapterRegistry
from pagedserve.protocol.lora_adapter import LoRAAdapterError
from pagedserve.runtime.options import lora_module
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.protocol.messages import ProcessReady
from pagedserve.runtime.process_exit import exit_now
from pagedserve.protocol.structured_outputs import preload_in_background
from pagedserve.protocol.zmq_io import Endpoints, Sender

log = logging.getLogger("pagedserve.frontend_proc")


def _announce_ready(endpoints: Endpoints) -> None:
    ctx = zmq.Context()
    sender = Sender(ctx, endpoints.supervisor())
    try:
        sender.send(ProcessReady(role="frontend", replica=-1, rank=0, pid=os.getpid()))
    finally:
        # A short linger so the frame leaves before the socket goes away.
        sender.sock.close(linger=2000)
        ctx.term()


def startup_adapters(config: FrontendConfig) -> Optional[AdapterRegistry]:
    """With --enable-lora, the registry holding each --lora-modules adapter (ids 1, 2, ... in the order
    given); ValueError naming a bad one (serve checked them already: this is a changed file)."""
    if not config.enable_lora:
        return None
    adapters = AdapterRegistry(config.model, config.max_lora_rank, [*config.served_model_names, *config.model_aliases])
    for item in config.lora_modules or ():
        name, path = lora_module(item)
        try:
            adapters.add(name, adapters.read(name, path))
        except (AdapterNameError, LoRAAdapterError) as exc:
            raise ValueError(f"--lora-modules {name}: {exc}") from None
    return adapters


async def serve(config: FrontendConfig, adapters: Optional[AdapterRegistry] = None) -> None:
    endpoints = Endpoints(config.run_dir)
    tokenizer = PromptTokenizer(config.model, config.chat_template)
    router = Router(config.num_replicas, config.replica_timeout_s, config.routing)
    engine = EngineClient(endpoints, router, config.max_waiting_requests, adapters)
    metrics = FrontendMetrics(router, config.served_model_names[0], lora_enabled=adapters is not None)
    serving = Serving(config.served_model_names, config.max_model_len, engine, tokenizer,
                      metrics, config.max_logprobs, config.tool_calling,
                      defaults=load_generation_defaults(config.generation_config, str(config.model)),
                      model_aliases=config.model_aliases, scheduling_policy=config.scheduling_policy,
                      tenant_header=config.tenant_header,
                      reasoning_parser=(get_reasoning_parser(config.reasoning_parser)
                                        if config.reasoning_parser else None), adapters=adapters)
    embeddings = EmbeddingServing(config.task, config.model, config.served_model_names, serving.accepted_model_names,
                                  config.max_model_len, engine, tokenizer, config.pooler, metrics)
    app = build_app(serving, router, metrics, config.api_key, embeddings)
    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.uvicorn_log_level or config.log_level,
        access_log=(config.uvicorn_log_level or config.log_level) in ("debug", "trace"),
        timeout_graceful_shutdown=config.drain_timeout_s + DRAIN_GRACE_S))
    # The tokenizer's imports (transformers, torch) leave millions of objects that live for
    # the whole process: freezing them keeps each collection proportional to the requests in
    # flight. Unfrozen, a full collection stalled every stream for tens of ms.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    engine.start()
    preload_in_background()  # structured output's grammar engine
    serve_task = asyncio.create_task(server.serve())
    drain_task = asyncio.create_task(end_requests_at_drain_deadline(
        server.exit_requested, engine, config.drain_timeout_s))
    try:
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.02)
        if server.started:
            await asyncio.to_thread(_announce_ready, endpoints)
            log.info("frontend serving %s on http://%s:%d for %d replica(s), %s routing",
                     config.served_model_names[0], config.host, config.port, config.num_replicas,
                     config.routing.kind)
        await serve_task
    finally:
        drain_task.cancel()
        await engine.close()


# Where the frontend and a scheduler share a core, the scheduler should win it: a step it
# sends late leaves the device idle for everyone, while a late SSE write delays one event.
# Measured on 2 cores, demo model, 64 streams: 4.8-9.6k tok/s with this against 3.9-4.7k
# without, TPOT mean 5.4-9.8 ms against 12.3-14.9 (bench/log/2026-11-23.md). Only ever lowers
# this process's priority, which needs no privilege.
FRONTEND_NICENESS = 5


def _yield_to_the_scheduler() -> None:
    try:
        os.nice(FRONTEND_NICENESS)
    except OSError as exc:  # a platform without nice: run at the default priority
        log.warning("could not lower the frontend's priority: %s", exc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        config = parse_args(argv)
        adapters = startup_adapters(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _yield_to_the_scheduler()
    _run(serve(config, adapters))
    return 0


def _run(main_coroutine) -> None:
    """On uvloop where it is installed (uvicorn's own choice for its `standard` extra): the
    frontend's cost is event-loop work per token (a queue wake, an SSE write), which uvloop
    does in C (bench/log/2026-11-25.md)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coroutine)
        return
    uvloop.run(main_coroutine)


if __name__ == "__main__":
    exit_now(main())
