"""``pagedserve serve`` options, validated once, and the command line of every child process."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pagedserve.protocol.generation_defaults import check_generation_config_option
from pagedserve.deploy.vllm_compat import DTYPE_CHOICES, resolve_dtype
from pagedserve.protocol.zmq_io import TcpLayout, is_loopback


ROUTER_KINDS = ("cache-aware", "least-loaded", "round-robin")  # frontend_proc/routing_policy.py
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # frontend_proc/tool_parsers/__init__.py
BACKENDS = ("mp", "ray")  # vLLM's names for --distributed-executor-backend


class ConfigError(ValueError):
    """A serve option that cannot work; the message says which and why."""


@dataclass(slots=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[list[str]] = None  # the first names the model in responses
    api_key: Optional[str] = None
    device: str = "cpu"
    dtype: str = "auto"  # vLLM's names; resolved to float32 | bfloat16 | float16 at construction
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None
    kv_cache_memory_gib: Optional[float] = None
    gpu_memory_utilization: Optional[float] = None  # vLLM's; how each worker reads it: worker_proc/kv_cache.py
    generation_config: str = "auto"  # auto | vllm | a directory: default sampling (protocol/generation_defaults.py)
    swap_space: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    async_scheduling: bool = True  # schedule step N+1 while the workers run step N
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    router: Optional[str] = None  # None: cache-aware when data_parallel_size > 1
    router_balance_abs: int = 2
    router_balance_rel: float = 1.25
    seed: int = 0
    debug_invariants: bool = False
    record_trace: Optional[str] = None
    step_timeout_s: float = 60.0
    replica_timeout_s: float = 5.0
    scheduler_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    run_dir_parent: Optional[str] = None
    num_threads: Optional[int] = None
    poison_kv_cache: bool = False
    log_level: str = "INFO"
    uvicorn_log_level: Optional[str] = None  # default: --log-level
    disable_log_requests: bool = True  # pagedserve never logs prompts or outputs; vLLM's flag is accepted
    chat_template: Optional[str] = None  # a file path or the template itself
    max_logprobs: int = 20  # vLLM's default: the most alternatives per token a request may ask for
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses calls with tool_call_parser
    tool_call_parser: Optional[str] = None
    internal_host: Optional[str] = None  # None: ipc sockets in the 0700 run dir
    internal_port_base: Optional[int] = None
    internal_curve: bool = False  # CurveZMQ even on loopback (always on off loopback)
    remote_workers: bool = False  # start no workers: they are launched by hand, e.g. on another node
    distributed_executor_backend: str = "mp"  # "ray": replicas placed by Ray (deploy/ray_supervisor.py)
    ray_address: Optional[str] = None  # None: RAY_ADDRESS, else a local ray.init()
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg_path = Path(self.model) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{self.model} is not a model directory (no config.json)")
        model_cfg = json.loads(cfg_path.read_text())
        limit = int(model_cfg.get("max_position_embeddings") or 2048)
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {DTYPE_CHOICES}")
        self.dtype = resolve_dtype(self.dtype, model_cfg, self.device)
        if self.max_model_len is None:
            self.max_model_len = limit
        if self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ConfigError(f"--max-logprobs must be at least 0, got {self.max_logprobs}")
        self._check_memory_options()
        if self.generation_config not in ("auto", "vllm"):
            self.generation_config = str(Path(self.generation_config).resolve())
        try:
            check_generation_config_option(self.generation_config, self.model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --data-parallel-size must be >= 1")
        if self.port < 0 or self.port > 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if not self.served_model_name:
            self.served_model_name = [Path(self.model).resolve().name]
        if self.chat_template is not None:
            self.chat_template = str(Path(self.chat_template).resolve()) \
                if Path(self.chat_template).is_file() else self.chat_template
            if "{" not in self.chat_template and not Path(self.chat_template).is_file():
                raise ConfigError(f"--chat-template {self.chat_template!r} is neither a file nor a "
                                  f"Jinja template")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser!r} is not known; choose one "
                              f"of {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                              f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.router is None:
            self.router = "cache-aware" if self.data_parallel_size > 1 else "least-loaded"
        if self.router not in ROUTER_KINDS:
            raise ConfigError(f"--router must be one of {', '.join(ROUTER_KINDS)}, got {self.router!r}")
        if self.router_balance_abs < 0 or self.router_balance_rel < 1.0:
            raise ConfigError("--router-balance-abs must be >= 0 and --router-balance-rel >= 1.0")
        self._check_internal_endpoints()
        if self.distributed_executor_backend not in BACKENDS:
            raise ConfigError(f"--distributed-executor-backend must be one of {', '.join(BACKENDS)}")
        if self.distributed_executor_backend == "ray" and (self.remote_workers or self.internal_host):
            raise ConfigError("--distributed-executor-backend ray places every process itself: drop "
                              "--remote-workers / --internal-host")

    def _check_memory_options(self) -> None:
        if self.gpu_memory_utilization is None:
            return
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gib is not None:
            raise ConfigError("--gpu-memory-utilization and --kv-cache-memory-gib both size the KV cache; "
                              "give one")

    def worker_memory_utilization(self) -> Optional[float]:
        """What each worker gets: on CUDA the share of its own device; on CPU the workers of
        this node share its RAM, so each gets its part of the share."""
        if self.gpu_memory_utilization is None or self.device != "cpu" or self.remote_workers:
            return self.gpu_memory_utilization
        return self.gpu_memory_utilization / (self.tensor_parallel_size * self.data_parallel_size)

    def _check_internal_endpoints(self) -> None:
        if (self.internal_host is None) != (self.internal_port_base is None):
            raise ConfigError("--internal-host and --internal-port-base go together "
                              "(internal endpoints are HOST:PORT_BASE+k)")
        if self.internal_curve and self.internal_host is None:
            raise ConfigError("--internal-curve needs --internal-host: ipc sockets are already "
                              "private to the 0700 run directory")
        if self.internal_host is not None:
            try:
                self.tcp_layout()
            except ValueError as exc:
                raise ConfigError(f"--internal-port-base: {exc}") from exc

    @property
    def uses_curve(self) -> bool:
        return self.internal_curve or (self.internal_host is not None and not is_loopback(self.internal_host))

    def tcp_layout(self) -> Optional[TcpLayout]:
        """Where the internal endpoints go when the operator asked for TCP; None for ipc."""
        if self.internal_host is None:
            return None
        return TcpLayout(self.internal_host, self.internal_port_base, self.tensor_parallel_size,
                         self.data_parallel_size, curve=self.uses_curve)

    def threads_per_worker(self) -> Optional[int]:
        """CPU threads per worker; None lets the worker pick (its cores, less one, over its TP size).

        Only this process knows that DP replicas share the node too, so with DP > 1 it
        splits the cores the same way over every local worker.
        """
        if self.num_threads or self.device != "cpu" or self.data_parallel_size == 1 or self.remote_workers:
            return self.num_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, (cores - 1) // (self.tensor_parallel_size * self.data_parallel_size))

    # ------------------------------------------------------------------ children

    def _py(self, module: str) -> list[str]:
        return [sys.executable, "-m", f"pagedserve.{module}"]

    def frontend_cmd(self, run_dir: str) -> list[str]:
        cmd = self._py("frontend_proc") + [
            "--run-dir", run_dir, "--model", self.model, "--served-model-name", *self.served_model_name,
            "--host", self.host, "--port", str(self.port), "--num-replicas", str(self.data_parallel_size),
            "--max-model-len", str(self.max_model_len), "--replica-timeout-s", str(self.replica_timeout_s),
            "--drain-timeout-s", str(self.drain_timeout_s), "--log-level", self.log_level.lower(),
            "--router", self.router, "--router-balance-abs", str(self.router_balance_abs),
            "--router-balance-rel", str(self.router_balance_rel),
            "--max-logprobs", str(self.max_logprobs), "--generation-config", self.generation_config]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.uvicorn_log_level:
            cmd += ["--uvicorn-log-level", self.uvicorn_log_level.lower()]
        if self.chat_template:
            cmd += ["--chat-template", self.chat_template]
        if self.tool_call_parser:
            cmd += ["--tool-call-parser", self.tool_call_parser]
        if self.enable_auto_tool_choice:
            cmd.append("--enable-auto-tool-choice")
        return cmd

    def scheduler_cmd(self, run_dir: str, replica: int) -> list[str]:
        cmd = self._py("scheduler_proc") + [
            "--run-dir", run_dir, "--model", self.model, "--replica", str(replica),
            "--tp-size", str(self.tensor_parallel_size),
            "--block-size", str(self.block_size), "--swap-space-gib", str(self.swap_space),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-model-len", str(self.max_model_len), "--preemption-mode", self.preemption_mode,
            "--seed", str(self.seed + replica), "--step-timeout-s", str(self.step_timeout_s),
            "--log-level", self.log_level]
        if self.num_gpu_blocks:
            cmd += ["--num-gpu-blocks", str(self.num_gpu_blocks)]
        cmd.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        cmd.append("--enable-chunked-prefill" if self.enable_chunked_prefill else "--no-enable-chunked-prefill")
        if self.debug_invariants:
            cmd.append("--debug-invariants")
        if not self.async_scheduling:
            cmd.append("--no-async-scheduling")
        if self.record_trace:
            path = self.record_trace if self.data_parallel_size == 1 else f"{self.record_trace}.{replica}"
            cmd += ["--record-trace", path]
        return cmd

    def worker_cmd(self, run_dir: str, replica: int, rank: int, dist_init: Optional[str]) -> list[str]:
        cmd = self._py("worker_proc") + [
            "--run-dir", run_dir, "--model", self.model, "--replica", str(replica), "--rank", str(rank),
            "--tp-size", str(self.tensor_parallel_size), "--device", self.device, "--dtype", self.dtype,
            "--block-size", str(self.block_size), "--log-level", self.log_level]
        if dist_init:
            cmd += ["--dist-init", dist_init]
        if self.kv_cache_memory_gib:
            cmd += ["--kv-cache-memory-gib", str(self.kv_cache_memory_gib)]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", repr(self.worker_memory_utilization())]
        threads = self.threads_per_worker()
        if threads:
            cmd += ["--num-threads", str(threads)]
        if self.poison_kv_cache:
            cmd.append("--poison-kv-cache")
        return cmd


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory (config.json + safetensors); default: the demo model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names clients may use for the model; responses carry the first")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights and KV cache; auto: the model config's dtype (float16 -> bfloat16 on CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks per device (default: as many as fit)")
    p.add_argument("--kv-cache-memory-gib", type=float, help="memory budget for the KV cache per device")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                   help="vLLM's: on CUDA the share of each device's memory the deployment may fill "
                        "(weights included; the KV cache takes what is left); on CPU the share of "
                        "RAM the KV caches may take (default: 90%% of free CUDA memory, 1 GiB on CPU)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters for requests that omit them: auto = the model "
                        "dir's generation_config.json, a directory = its generation_config.json, "
                        "vllm = none (vLLM's own defaults)")
    p.add_argument("--swap-space", type=float, default=1.0, help="host swap space per replica, GiB")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next step while the workers run this one (default on; "
                        "--no-async-scheduling waits for every step's result before the next)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--router", choices=ROUTER_KINDS, default=None,
                   help="how requests are spread over data-parallel replicas: cache-aware sends each "
                        "to the replica holding the longest cached prefix of its prompt (needs "
                        "--enable-prefix-caching), unless it is busier than the load bound allows, then "
                        "to the least loaded; least-loaded; round-robin (default: cache-aware when "
                        "--data-parallel-size > 1; docs/DECISIONS.md)")
    p.add_argument("--router-balance-abs", type=int, default=2,
                   help="cache-aware: the cache winner may carry this many more sequences than the "
                        "least-loaded replica (default %(default)s)")
    p.add_argument("--router-balance-rel", type=float, default=1.25,
                   help="cache-aware: ... or up to this many times its load (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug-invariants", action="store_true", help="check block-manager invariants every step")
    p.add_argument("--record-trace", metavar="PATH", help="record the protocol to a trace file")
    p.add_argument("--step-timeout-s", type=float, default=60.0, help="a step slower than this is a hung worker")
    p.add_argument("--replica-timeout-s", type=float, default=5.0)
    p.add_argument("--scheduler-timeout-s", type=float, default=30.0,
                   help="a scheduler silent for this long (alive but no heartbeat) is hung and restarted")
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="SIGTERM grace period")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--restart-window-s", type=float, default=300.0)
    p.add_argument("--run-dir-parent", help="where the private 0700 run directory is created")
    p.add_argument("--num-threads", type=int, help="CPU threads per worker")
    p.add_argument("--poison-kv-cache", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--uvicorn-log-level", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's log level (default: --log-level)")
    p.add_argument("--disable-log-requests", action="store_true", default=True,
                   help="accepted for vLLM command lines: pagedserve never logs prompts or outputs")
    p.add_argument("--max-logprobs", type=int, default=20, help="most logprobs alternatives per token (larger: 400)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template text) instead of the model's")
    add_tool_calling_args(p)
    g = p.add_argument_group("beyond one node (deploy/README.md)")
    g.add_argument("--internal-host", metavar="HOST",
                   help="put the internal ZMQ endpoints on TCP at this IP (default: ipc sockets in the "
                        "private run dir); CurveZMQ is required unless it is a loopback address")
    g.add_argument("--internal-port-base", type=int, metavar="PORT",
                   help="internal endpoint k listens on PORT+k; uses 2 + 2 x DP ports")
    g.add_argument("--internal-curve", action="store_true",
                   help="encrypt and authenticate the internal TCP endpoints with CurveZMQ even on loopback")
    g.add_argument("--remote-workers", action="store_true",
                   help="start no workers; write their command lines to RUN_DIR/worker-commands.sh "
                        "for the operator to run (on this or another node)")
    g.add_argument("--distributed-executor-backend", choices=BACKENDS, default="mp",
                   help="mp: every process on this node; ray: each replica placed on a Ray cluster "
                        "node (pip install -e \".[ray]\")")
    g.add_argument("--ray-address", metavar="ADDRESS",
                   help="the Ray cluster to join (default: $RAY_ADDRESS, else a local ray.init())")


def add_tool_calling_args(p: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags, passed on to the frontend (frontend_proc/args.py)."""
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests use tool_choice "auto": tool calls are parsed from the output '
                        "by --tool-call-parser")
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help=f"how tool calls are written in the model's output: {', '.join(TOOL_CALL_PARSERS)} "
                        "(hermes: Qwen2.5 and Hermes models; llama3_json: Llama 3.1+)")


def serve_config_from_args(ns: argparse.Namespace, model: str) -> ServeConfig:
    names = ServeConfig.__dataclass_fields__.keys() - {"model", "extra"}
    return ServeConfig(model=model, **{k: getattr(ns, k) for k in names})
