"""Command line of the frontend process, parsed once into a validated FrontendConfig.

Its serve options (host, port, routing, limits, ...) are fields generated from
runtime/options.py, so their flags, defaults and checks are ``pagedserve serve``'s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from pagedserve.client.routing_policy import RoutingPolicy, default_router
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig
from pagedserve.client.pooling import PoolerSettings, pooler_settings
from pagedserve.runtime import options as opts

DEFAULT_MAX_MODEL_LEN = 2048  # a model directory that states no max_position_embeddings


class _FrontendConfigRules:
    def __post_init__(self) -> None:
        opts.validate(opts.values_of(self, opts.options_for(opts.FRONTEND)))
        if not self.served_model_name or any(not n for n in self.served_model_name):
            raise ValueError("--served-model-name needs at least one non-empty name")
        RoutingPolicy(self.router, self.router_balance_abs, self.router_balance_rel)  # its checks
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        pooler_settings(self.pooling_type, self.pooler_config)  # its checks

    @property
    def pooler(self) -> PoolerSettings:
        return pooler_settings(self.pooling_type, self.pooler_config)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return tuple(self.served_model_name)

    @property
    def num_replicas(self) -> int:
        return self.data_parallel_size

    @property
    def tool_calling(self) -> ToolCallingConfig:
        return ToolCallingConfig(self.enable_auto_tool_choice, self.tool_call_parser)

    @property
    def routing(self) -> RoutingPolicy:
        return RoutingPolicy(self.router, self.router_balance_abs, self.router_balance_rel)


FrontendConfig = opts.make_config(
    "FrontendConfig", [("run_dir", Path), ("model", Path), *opts.dataclass_fields(opts.FRONTEND),
                       ("model_aliases", tuple, ())],
    _FrontendConfigRules, frozen=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedserve.frontend_proc",
        description="pagedserve OpenAI-compatible HTTP frontend",
    )
    p.add_argument("--run-dir", required=True, type=Path,
                   help="the deployment's private (0700) directory holding its ipc sockets")
    p.add_argument("--model", required=True, type=Path,
                   help="HF model directory (tokenizer, config.json, generation_config.json)")
    p.add_argument("--model-alias", action="append", default=[], dest="model_aliases",
                   help="another name a request may give the model (not listed by /v1/models)")
    opts.add_arguments(p, opts.FRONTEND)
    return p


def _default_max_model_len(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_MODEL_LEN
    return int(config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)


def parse_args(argv: Optional[Sequence[str]] = None) -> FrontendConfig:
    ns = build_parser().parse_args(argv)
    model = ns.model.resolve()
    values = {o.name: getattr(ns, o.name) for o in opts.options_for(opts.FRONTEND)}
    values.update(
        served_model_name=tuple(ns.served_model_name or [model.name]),
        max_model_len=ns.max_model_len or _default_max_model_len(model),
        log_level=opts.uvicorn_log_level(ns.log_level),
        router=default_router(ns.data_parallel_size, ns.router),
    )
    return FrontendConfig(run_dir=ns.run_dir, model=model, model_aliases=tuple(ns.model_aliases), **values)
