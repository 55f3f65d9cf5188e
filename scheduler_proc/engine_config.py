"""Everything the scheduler process is started with, validated once.

The serve options it takes (block size, budgets, preemption, ...) are fields generated from
runtime/options.py, so their flags, defaults and checks are ``pagedserve serve``'s; the
rest is this process's own wiring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

from pagedserve.runtime import options as opts
from pagedserve.protocol.kv_groups import KVGroups
from pagedserve.protocol.priority import parse_tenant_weights, tenant_weights_text
from pagedserve.protocol.speculative import parse_speculative_config
from pagedserve.scheduler_proc.config import SchedulerConfig

DEFAULT_MAX_MODEL_LEN = 2048  # without --max-model-len or a model that states its own

# Not serve options: how the supervisor wires this process, and its internal cadences.
_WIRING = [
    ("run_dir", str),
    ("replica", int, dataclasses.field(default=0)),
    ("worker_start_timeout_s", float, dataclasses.field(default=300.0)),
    ("stats_interval_s", float, dataclasses.field(default=0.5)),
    ("log_interval_s", float, dataclasses.field(default=5.0)),
    # informational: recorded in traces so a replay finds the weights
    ("model", Optional[str], dataclasses.field(default=None)),
]


class _EngineConfigRules:
    def __post_init__(self) -> None:
        opts.validate(opts.values_of(self, opts.options_for(opts.SCHEDULER)))
        if self.worker_start_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_model_len is None:
            self.max_model_len = _model_max_len(self.model)
        if self.tenant_weights is not None:  # inline, so a trace's replay needs no file
            self.tenant_weights = tenant_weights_text(parse_tenant_weights(self.tenant_weights))
        if self.max_num_batched_tokens is None:  # started by hand: serve passes the device's default
            self.max_num_batched_tokens = opts.CPU_STEP_TOKENS
        # Fail at startup, not at the first handshake: the cache size is still unknown
        # here, so validate the policy options with a placeholder one.
        self.scheduler_config(num_gpu_blocks=1 << 20, num_cpu_blocks=int(self.swap_space > 0))

    def scheduler_config(self, num_gpu_blocks: int, num_cpu_blocks: int, vocab_size: int = 0,
                         sliding_window: int = 0, groups: Optional[KVGroups] = None) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill, preemption_mode=self.preemption_mode,
            debug_invariants=self.debug_invariants, seed=self.seed, vocab_size=vocab_size,
            scheduling_policy=self.scheduling_policy, priority_aging_s=self.priority_aging_s,
            max_waiting_requests=self.max_waiting_requests, max_queue_time_s=self.max_queue_time_s,
            default_deadline_s=self.default_deadline_s, tenant_weights=self.tenant_weights,
            speculative=parse_speculative_config(self.speculative_config),
            enable_lora=self.enable_lora, max_loras=self.max_loras, sliding_window=sliding_window,
            num_window_groups=groups.num_window_groups if groups else 0, hybrid_window=groups.window if groups else 0,
        )

    def speculative_method(self) -> Optional[str]:
        spec = parse_speculative_config(self.speculative_config)
        return spec.method if spec is not None else None

    def trace_config(self) -> dict:
        """What a replay needs to rebuild this scheduler (paths, timeouts and logging left out)."""
        skip = {"run_dir", "record_trace", "step_timeout_s", "worker_start_timeout_s",
                "stats_interval_s", "log_interval_s", "log_level"}
        config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        if self.model:  # a replay from another directory still finds the weights
            config["model"] = os.path.abspath(self.model)
        return config

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run-dir", required=True)
        p.add_argument("--model", default=None)
        p.add_argument("--replica", type=int, default=0)
        opts.add_arguments(p, opts.SCHEDULER)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _model_max_len(model: Optional[str]) -> int:
    path = Path(model or "") / "config.json"
    if model is None or not path.is_file():
        return DEFAULT_MAX_MODEL_LEN
    return int(json.loads(path.read_text()).get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)


EngineConfig = opts.make_config(
    "EngineConfig", [_WIRING[0], *opts.dataclass_fields(opts.SCHEDULER), *_WIRING[1:]], _EngineConfigRules)
