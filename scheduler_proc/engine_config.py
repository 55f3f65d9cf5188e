"""Everything the scheduler process is started with, validated once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional

from pagedserve.scheduler_proc.config import SchedulerConfig


@dataclass(slots=True)
class EngineConfig:
    run_dir: str
    replica: int = 0
    tp_size: int = 1
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None  # None: as many as fit
    swap_space_gib: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    debug_invariants: bool = False
    async_scheduling: bool = True  # schedule step N+1 while the workers run step N
    seed: int = 0
    step_timeout_s: float = 60.0
    worker_start_timeout_s: float = 300.0
    stats_interval_s: float = 0.5
    log_interval_s: float = 5.0
    record_trace: Optional[str] = None
    model: Optional[str] = None  # informational: recorded in traces so a replay finds the weights

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.step_timeout_s <= 0 or self.worker_start_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap space must be >= 0 GiB, got {self.swap_space_gib}")
        # Fail at startup, not at the first handshake: the cache size is still unknown
        # here, so validate the policy options with a placeholder one.
        self.scheduler_config(num_gpu_blocks=1 << 20, num_cpu_blocks=int(self.swap_space_gib > 0))

    def scheduler_config(self, num_gpu_blocks: int, num_cpu_blocks: int, vocab_size: int = 0) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill, preemption_mode=self.preemption_mode,
            debug_invariants=self.debug_invariants, seed=self.seed, vocab_size=vocab_size,
        )

    def trace_config(self) -> dict:
        """What a replay needs to rebuild this scheduler (paths and timeouts left out)."""
        skip = {"run_dir", "record_trace", "step_timeout_s", "worker_start_timeout_s",
                "stats_interval_s", "log_interval_s"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        for f in fields(EngineConfig):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                kind = {"int": int, "float": float, "str": str}.get(
                    str(f.type).replace("Optional[", "").rstrip("]"), str)
                p.add_argument(flag, type=kind, default=None if f.name == "run_dir" else f.default,
                               required=f.name == "run_dir")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
