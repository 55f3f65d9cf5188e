"""Command line of the frontend process, parsed once into a validated FrontendConfig."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pagedserve.frontend_proc.routing_policy import (
    DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL, ROUTER_KINDS, RoutingPolicy, default_router)
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig
from pagedserve.frontend_proc.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    run_dir: Path
    model: Path
    served_model_names: tuple[str, ...]  # the first names the model in responses
    host: str
    port: int
    num_replicas: int
    max_model_len: int
    api_key: Optional[str]
    replica_timeout_s: float
    log_level: str
    drain_timeout_s: float = 30.0
    uvicorn_log_level: Optional[str] = None
    chat_template: Optional[str] = None  # a file path or the template text
    max_logprobs: int = 20  # alternatives per token a request may ask for
    generation_config: str = "auto"  # where default sampling comes from (protocol/generation_defaults.py)
    tool_calling: ToolCallingConfig = ToolCallingConfig()

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]
    routing: RoutingPolicy = RoutingPolicy()

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise ValueError("--served-model-name needs at least one non-empty name")
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1, got {self.num_replicas}")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.replica_timeout_s <= 0:
            raise ValueError(f"--replica-timeout-s must be positive, got {self.replica_timeout_s}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be at least 0, got {self.max_logprobs}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedserve.frontend_proc",
        description="pagedserve OpenAI-compatible HTTP frontend",
    )
    p.add_argument("--run-dir", required=True, type=Path,
                   help="the deployment's private (0700) directory holding its ipc sockets")
    p.add_argument("--model", required=True, type=Path,
                   help="HF model directory (tokenizer, config.json, generation_config.json)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use; responses carry the first (default: the model dir's basename)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output token limit (default: max_position_embeddings)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--replica-timeout-s", type=float, default=5.0,
                   help="a replica whose last stats are older than this is down")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish")
    add_router_args(p)
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--uvicorn-log-level", default=None, type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs alternatives per token a request may ask for (larger: 400)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling for requests that omit it: the model dir's (auto), a "
                        "directory's generation_config.json, or none (vllm)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or the template text, instead of the model's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests use tool_choice "auto" (calls parsed by --tool-call-parser)')
    p.add_argument("--tool-call-parser", default=None,
                   help=f"how tool calls are written in the output: {', '.join(sorted(TOOL_PARSERS))}")
    return p


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", choices=ROUTER_KINDS, default=None,
                   help="how requests are spread over data-parallel replicas: cache-aware sends each "
                        "to the replica holding the longest prefix of its prompt, unless that replica "
                        "is busier than the load bound allows (then least-loaded); least-loaded; "
                        "round-robin (default: cache-aware with more than one replica; "
                        "docs/DECISIONS.md)")
    p.add_argument("--router-balance-abs", type=int, default=DEFAULT_BALANCE_ABS,
                   help="cache-aware: the cache winner may carry this many more sequences than the "
                        "least-loaded replica (default %(default)s)")
    p.add_argument("--router-balance-rel", type=float, default=DEFAULT_BALANCE_REL,
                   help="cache-aware: ... or up to this many times its load (default %(default)s)")


def _default_max_model_len(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 2048
    return int(config.get("max_position_embeddings") or 2048)


def parse_args(argv: Optional[Sequence[str]] = None) -> FrontendConfig:
    ns = build_parser().parse_args(argv)
    model = ns.model.resolve()
    return FrontendConfig(
        run_dir=ns.run_dir,
        model=model,
        served_model_names=tuple(ns.served_model_name or [model.name]),
        host=ns.host,
        port=ns.port,
        num_replicas=ns.num_replicas,
        max_model_len=ns.max_model_len or _default_max_model_len(model),
        api_key=ns.api_key,
        replica_timeout_s=ns.replica_timeout_s,
        log_level=ns.log_level,
        drain_timeout_s=ns.drain_timeout_s,
        uvicorn_log_level=ns.uvicorn_log_level,
        chat_template=ns.chat_template,
        routing=RoutingPolicy(default_router(ns.num_replicas, ns.router), ns.router_balance_abs,
                              ns.router_balance_rel),
        max_logprobs=ns.max_logprobs,
        generation_config=ns.generation_config,
        tool_calling=ToolCallingConfig(ns.enable_auto_tool_choice, ns.tool_call_parser),
    )
