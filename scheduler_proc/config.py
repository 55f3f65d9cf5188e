"""The scheduler's configuration: one slotted dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedserve.runtime.options import PREEMPTION_MODES
from pagedserve.protocol.priority import POLICIES_WITH_PRIORITY, SCHEDULING_POLICIES, parse_tenant_weights
from pagedserve.protocol.speculative import SpeculativeConfig

# Sequences are ordered by (arrival number, sample index) packed into one int; see request.py.
MAX_PARALLEL_SAMPLES = 1 << 20
DEFAULT_DEADLINE_S = 60.0  # --default-deadline-s when not given (runtime/options.py says so)


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int = 16
    num_gpu_blocks: int = 512
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"  # "auto" | "swap" | "recompute"
    debug_invariants: bool = False
    seed: int = 0
    vocab_size: int = 0  # from the workers' hello: token ids at or above it are refused; 0: unchecked
    scheduling_policy: str = "fcfs"  # protocol/priority.py SCHEDULING_POLICIES; policy.py
    priority_aging_s: Optional[float] = None  # priority policy: one level lifted per interval; None: off
    max_waiting_requests: Optional[int] = None  # past it a new request is refused (load shedding); None: no limit
    max_queue_time_s: Optional[float] = None  # the wait for a first token (deadlines.py); None: no limit
    default_deadline_s: Optional[float] = None  # deadline policy: a request without one is ordered by arrival + this
    tenant_weights: Optional[str] = None  # fair policy: NAME=WEIGHT,... (protocol/priority.py); None: all 1
    speculative: Optional[SpeculativeConfig] = None  # --speculative-config (speculation.py); None: off
    enable_lora: bool = False  # requests may name a registered LoRA adapter (lora_slots.py)
    max_loras: int = 4  # adapters one step may hold: the workers' device slots
    # Every layer of the model attends this many positions back: blocks behind it are freed
    # (sliding_window.py); 0: every block is kept until its sequence ends.
    sliding_window: int = 0
    # Global and local layers alternate (protocol/kv_groups.py): a block table per group, the
    # local groups' blocks behind ``hybrid_window`` freed (sliding_window.py); 0: one table.
    num_window_groups: int = 0
    hybrid_window: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be an integer >= 0, got {self.sliding_window!r}")
        for name in ("num_window_groups", "hybrid_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if (self.num_window_groups > 0) != (self.hybrid_window > 0) or (self.num_window_groups and self.sliding_window):
            raise ValueError(f"num_window_groups={self.num_window_groups} and hybrid_window={self.hybrid_window} "
                             f"go together, and not with sliding_window={self.sliding_window}")
        if self.sliding_window and self.speculative is not None and self.speculative.method == "draft_model":
            raise ValueError("sliding_window frees blocks a draft model's layers may still read: "
                             "the engine keeps every block with a draft model")
        if not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be an integer >= 2 (one prompt token and one output), "
                f"got {self.max_model_len!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.priority_aging_s is not None and self.scheduling_policy not in POLICIES_WITH_PRIORITY:
            raise ValueError("priority_aging_s ages priorities: it needs scheduling_policy \"priority\" or \"deadline\"")
        if self.tenant_weights is not None:
            if self.scheduling_policy != "fair":
                raise ValueError("tenant_weights weigh tenants' shares: it needs scheduling_policy=\"fair\"")
            parse_tenant_weights(self.tenant_weights)
        if self.default_deadline_s is None:  # None so that serve can tell it was not given
            self.default_deadline_s = DEFAULT_DEADLINE_S
        if self.max_num_seqs >= MAX_PARALLEL_SAMPLES:
            raise ValueError(f"max_num_seqs must be below {MAX_PARALLEL_SAMPLES}, got {self.max_num_seqs}")
        if not self.enable_chunked_prefill:
            # Without chunking a prompt is computed in one step, so one step must hold the
            # longest prompt the model accepts. Serve refuses a smaller budget the user gave
            # (deploy/serve_config.py); here it can only be a default or a trace's value.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running decode needs one token of the budget each step; a smaller budget
            # would starve some decodes, which this scheduler promises never to do.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode every step"
            )
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ValueError('preemption_mode="swap" needs num_cpu_blocks > 0 (the host swap space)')
