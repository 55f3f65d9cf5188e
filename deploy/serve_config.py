"""``pagedserve serve`` options, validated once, and the command line of every child process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
from pathlib import Path
from typing import Optional

from pagedserve.deploy.entry_points import python_module
from pagedserve.runtime import options as opts
from pagedserve.protocol.lora_adapter import LoRAAdapterError
from pagedserve.protocol.model_architectures import (ARCHITECTURES, EXPERT_COUNT_KEYS, LONGROPE_LIMIT, ModelConfigError,
                                                     check_model_config, longrope_limit)
from pagedserve.client.generation_defaults import check_generation_config_option
from pagedserve.client.lora_adapters import (AdapterNameError, adaptable_projections, check_adapter_name,
                                             read_model_adapter)
from pagedserve.client.pooling import pooler_settings
from pagedserve.protocol.speculative import SpeculativeConfigError, check_draft_model, parse_speculative_config
from pagedserve.deploy.gguf_model_dir import gguf_model_dir
from pagedserve.protocol.gguf_file import (NATIVE_TYPES, GGUFFileError, GGUFSummary, find_gguf, read_source,
                                           summarize)
from pagedserve.protocol.gguf_file import quantization_spec as gguf_quantization_spec
from pagedserve.protocol.quantization import (QuantizationConfigError, check_shapes, gpu_serves,
                                              parse_quantization_config, projection_inputs)
from pagedserve.runtime.options import FRONTEND, ROUTER_KINDS, SCHEDULER, WORKER, resolve_device, resolve_dtype
from pagedserve.protocol.zmq_io import TcpLayout, is_loopback

__all__ = ["ConfigError", "ROUTER_KINDS", "ServeConfig", "add_serve_args", "serve_config_from_args"]


ALLOW_LONG_MAX_MODEL_LEN = "PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN
# Options only the generating path reads; --task embed refuses each at a non-default value.
# Options only LoRA reads; refused at a non-default value without --enable-lora.
LORA_ONLY = ("lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")
GENERATION_ONLY = ("reasoning_parser", "enable_auto_tool_choice", "tool_call_parser", "max_logprobs",
                   "speculative_config", "chat_template", "generation_config")


class ConfigError(opts.OptionError):
    """A serve option that cannot work; the message says which and why."""


class _ServeConfigRules:
    """ServeConfig's rules and child command lines; its fields are runtime/options.py's OPTIONS."""

    def __post_init__(self) -> None:
        self._serve_gguf()
        cfg_path = Path(self.model) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{self.model} is not a model directory (no config.json)")
        try:  # the workers' own check, so a model they would refuse is refused before any process starts
            check_model_config(self.model, self.model_impl)
        except ModelConfigError as exc:
            raise ConfigError(str(exc)) from None
        model_cfg = json.loads(cfg_path.read_text())
        limit = int(model_cfg.get("max_position_embeddings") or 2048)
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...}), as vLLM's
            self.speculative_config = json.dumps(self.speculative_config)
        if self.uvicorn_log_level is not None:
            self.uvicorn_log_level = self.uvicorn_log_level.lower()
        self.task = opts.task_name(self.task)  # vLLM's --runner pooling, LLM(runner="pooling")
        if self.seed is None:  # vLLM's seed=None: no fixed seed, so one drawn now (a trace records it)
            self.seed = secrets.randbelow(2**31)
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.lower()
        try:
            opts.validate(opts.values_of(self, opts.OPTIONS))
        except opts.OptionError as exc:
            raise ConfigError(str(exc)) from None
        try:
            self.device = resolve_device(self.device)
        except opts.OptionError as exc:
            raise ConfigError(str(exc)) from None
        local_replicas = 1 if self.remote_workers else self.data_parallel_size
        self.dtype = resolve_dtype(self.dtype, model_cfg, self.device, self.model, local_replicas)
        self._check_max_model_len(limit, longrope_limit(model_cfg))
        self._check_step_budget()
        self._check_quantization(model_cfg)
        if self.kv_cache_dtype != "auto" and self.device == "cpu":
            # the CPU attention reads the model's dtype: at 12 streams of 2,000 tokens it waited on neither the
            # cache's bytes (35% of the memory's rate) nor its arithmetic, so a float8 cache was not built there
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype} runs on a GPU (its Triton attention); on "
                              f"CPU the KV cache keeps --dtype")
        if self.model_aliases is None:  # once: a replace() keeps what the first call found
            # vLLM serves `vllm serve /models/x` as "/models/x", and its clients (vllm bench
            # serve among them) send that name; the directory's name stays the listed one.
            primary = self.served_model_name[0] if self.served_model_name else Path(self.model).resolve().name
            self.model_aliases = [] if self.served_model_name or self.model == primary else [self.model]
        if not self.served_model_name:
            self.served_model_name = [Path(self.model).resolve().name]
        self._check_lora(model_cfg)
        self._check_expert_parallel(model_cfg)
        if self.chat_template is not None:
            self.chat_template = str(Path(self.chat_template).resolve()) \
                if Path(self.chat_template).is_file() else self.chat_template
            if "{" not in self.chat_template and not Path(self.chat_template).is_file():
                raise ConfigError(f"--chat-template {self.chat_template!r} is neither a file nor a "
                                  f"Jinja template")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                              f"{', '.join(opts.TOOL_CALL_PARSERS)})")
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            raise ConfigError("--tool-call-parser is only read for tool_choice \"auto\": it needs "
                              "--enable-auto-tool-choice")
        self._check_generation_only_options()
        try:
            pooler_settings(self.pooling_type, self.pooler_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.task != "embed" and (self.pooling_type or self.pooler_config):
            raise ConfigError("--pooling-type and --pooler-config are for --task embed (vLLM's --runner pooling)")
        self._check_memory_options()
        self._check_speculative_config()
        if self.generation_config not in ("auto", "vllm"):
            self.generation_config = str(Path(self.generation_config).resolve())
        try:
            check_generation_config_option(self.generation_config, self.model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._check_router()
        self._check_internal_endpoints()
        if self.distributed_executor_backend == "ray" and (self.remote_workers or self.internal_host):
            raise ConfigError("--distributed-executor-backend ray places every process itself: drop "
                              "--remote-workers / --internal-host")
        self._check_unread_options()

    def _check_lora(self, model_cfg: dict) -> None:
        """LoRA settings every process would honour, and each --lora-modules adapter read and judged
        against this model (the frontend reads it again when it registers it)."""
        if not self.enable_lora:
            given = [opts.BY_NAME[n].flag for n in LORA_ONLY if getattr(self, n) != opts.BY_NAME[n].default]
            if given:
                raise ConfigError(f"{', '.join(given)}: LoRA option(s) that need --enable-lora")
            return
        if self.task == "embed":
            raise ConfigError("--enable-lora: adapters are served for generation only, not by --task embed")
        arch = next((a for a in model_cfg.get("architectures") or () if a in ARCHITECTURES), None)
        if self.model_impl == "transformers" or arch is None:
            raise ConfigError(f"--enable-lora: adapters run on the native model families only, and "
                              f"{'--model-impl transformers' if arch else 'this architecture'} runs the model "
                              f"through the transformers backend")
        try:
            adaptable_projections(model_cfg)
        except LoRAAdapterError as exc:
            raise ConfigError(f"--enable-lora: {exc}") from None
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                              f"({self.max_loras}): every adapter in a slot is also held in host memory")
        names: list[str] = []
        modules = []  # each path resolved: every child reads the same directory
        for item in self.lora_modules or ():
            name, path = _lora_module(item, self.served_model_name)
            try:
                if name in names:
                    raise AdapterNameError(f"the name {name!r} is given twice")
                check_adapter_name(name, [*self.served_model_name, *(self.model_aliases or ())])
                spec = read_model_adapter(path, model_cfg, self.max_lora_rank)
            except (AdapterNameError, LoRAAdapterError) as exc:
                raise ConfigError(f"--lora-modules {name}: {exc}") from None
            names.append(name)
            if item.lstrip().startswith("{"):
                modules.append(json.dumps({**json.loads(item), "path": spec.path}))
            else:
                modules.append(f"{name}={spec.path}")
        if self.lora_modules:
            self.lora_modules = modules

    def _check_expert_parallel(self, model_cfg: dict) -> None:
        """``--enable-expert-parallel`` needs routed experts the native family places, a tensor-parallel
        size that divides them, and no LoRA across ranks (the workers refuse the same, in the same words)."""
        if not self.enable_expert_parallel:
            return
        key = next((k for k in EXPERT_COUNT_KEYS if model_cfg.get(k)), None)
        arch = next((a for a in model_cfg.get("architectures") or () if a in ARCHITECTURES), None)
        if key is None or arch is None or self.model_impl == "transformers":
            name = (model_cfg.get("architectures") or ["this model"])[0]
            raise ConfigError(f"--enable-expert-parallel: {name} has no mixture of experts to place"
                              if key is None else "--enable-expert-parallel: experts are placed by the native model "
                              "families only, not the transformers backend")
        tp, experts = self.tensor_parallel_size, model_cfg[key]
        if experts % tp:
            raise ConfigError(f"--enable-expert-parallel: tensor-parallel size {tp} does not divide the {experts} "
                              f"experts ({key}); pick a tp_size that does")
        if self.enable_lora and tp > 1:
            raise ConfigError("--enable-lora does not run with --enable-expert-parallel at --tensor-parallel-size > 1")

    def _serve_gguf(self) -> None:
        """A GGUF file (or a directory of one) is served from the model directory made of it
        (deploy/gguf_model_dir.py): every child reads that one; the file's name is the listed model."""
        if read_source(self.model) is not None:  # the directory made of one already (a replace() of this config)
            return
        try:
            gguf = find_gguf(self.model, self.load_format)
        except GGUFFileError as exc:
            raise ConfigError(str(exc)) from None
        if gguf is None:
            if self.load_format == "gguf":
                raise ConfigError(f"--load-format gguf: {self.model} is not a .gguf file or a directory holding one")
            if self.tokenizer is not None:
                raise ConfigError("--tokenizer replaces a GGUF file's tokenizer; a model directory's own is served")
            return
        if self.model_impl == "transformers":
            raise ConfigError("--model-impl transformers: a GGUF model runs on the native families only")
        try:
            made = gguf_model_dir(gguf, self.tokenizer)
        except ValueError as exc:  # GGUFFileError among them
            raise ConfigError(str(exc)) from None
        if self.model_aliases is None and not self.served_model_name:
            name = Path(self.model).resolve().name
            self.served_model_name, self.model_aliases = [name], ([] if self.model == name else [self.model])
        self.model = str(made)

    def _check_quantization(self, model_cfg: dict) -> None:
        """A quantized checkpoint the workers could not load is refused here, before any process starts."""
        try:
            spec = parse_quantization_config(model_cfg, self.quantization)
            if spec is not None:
                check_shapes(spec, projection_inputs(model_cfg), self.tensor_parallel_size)
        except (QuantizationConfigError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(str(exc) if isinstance(exc, QuantizationConfigError)
                              else f"config.json: {exc!r} is missing or malformed") from None
        summary = self._gguf_summary()
        gguf_types = [t for t in summary.tensor_types if t in NATIVE_TYPES] if summary else []
        if gguf_types and self.tensor_parallel_size > 1:
            try:  # a rank's slice of o_proj's / down_proj's inputs must hold whole groups (32), and whole blocks
                inputs, tp = projection_inputs(model_cfg), self.tensor_parallel_size
                check_shapes(gguf_quantization_spec(gguf_types[0]), inputs, tp)
                for name, (kind, block) in summary.row_parallel_blocks.items():
                    if (inputs[name] // tp) % block:  # a k-quant's 256, which holds 8 groups of 32
                        raise QuantizationConfigError(f"{name}'s {inputs[name]} inputs split {tp} ways cut a {kind} "
                                                      f"block ({block} values); pick another --tensor-parallel-size")
            except QuantizationConfigError as exc:
                raise ConfigError(f"GGUF {', '.join(gguf_types)}: {exc}") from None
        arch = next((a for a in model_cfg.get("architectures") or () if a in ARCHITECTURES), None)
        if spec is not None and (self.model_impl == "transformers" or arch is None):
            # the worker refuses it too (model_runner.py): transformers would decompress every weight
            raise ConfigError(f"quantized checkpoints ({spec.name}) run on the native model families only, and "
                              f"{'--model-impl transformers' if arch else 'this architecture'} runs the model "
                              f"through the transformers backend")
        spec = spec or (gguf_quantization_spec(gguf_types[0]) if gguf_types else None)
        if spec is not None and self.device != "cpu" and not gpu_serves(spec):
            raise ConfigError(f"{spec.name} runs on CPU only: --device cpu (a GPU serves FP8 and weight-only int4 / "
                              f"int8 checkpoints)")

    def _gguf_summary(self) -> Optional[GGUFSummary]:
        """The GGUF this model directory was made of, as serve checks it (protocol/gguf_file.py), or None."""
        source = read_source(self.model)
        if source is None:
            return None
        try:
            return summarize(source.path)
        except GGUFFileError as exc:
            raise ConfigError(str(exc)) from None

    def _check_max_model_len(self, limit: int, exact: Optional[int] = None) -> None:
        """``exact``: the longest sequence the workers compute exactly (a longrope model's original
        length), the default where it is shorter than the model's positions; more is refused."""
        if self.max_model_len is None:
            self.max_model_len = limit if exact is None else min(limit, exact)
        elif exact is not None and self.max_model_len > exact:
            raise ConfigError(f"--max-model-len: {LONGROPE_LIMIT.format(limit=exact, asked=self.max_model_len)}")
        elif self.max_model_len > limit and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
            # Positions past the trained range give garbage, not an error: vLLM refuses them too.
            raise ConfigError(f"--max-model-len: User-specified max_model_len ({self.max_model_len}) is greater "
                              f"than the derived max_model_len (max_position_embeddings={limit} in the model's "
                              f"config.json); set {ALLOW_LONG_MAX_MODEL_LEN}=1 to allow it anyway")

    def _check_step_budget(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = opts.default_step_tokens(self.device)
            if not self.enable_chunked_prefill:  # one step must hold the longest prompt
                self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than "
                              f"--max-model-len ({self.max_model_len}): without chunked prefill a prompt is "
                              f"computed in one step; increase max_num_batched_tokens or decrease max_model_len")

    def _check_generation_only_options(self) -> None:
        if self.task != "embed":
            return
        # The embedding path reads none of these (nor the chat template: /v1/embeddings takes
        # text or token ids), and a speculative draft model would be loaded for nothing.
        given = [opts.BY_NAME[name].flag for name in GENERATION_ONLY
                 if getattr(self, name) != opts.BY_NAME[name].default]
        if given:
            raise ConfigError(f"{', '.join(given)}: generation only, not read by --task embed")

    def _check_router(self) -> None:
        # Cache-aware routing ranks replicas by the prefix blocks they cache: with no prefix
        # cache every replica ties and it is least-loaded under another name.
        if self.router is None:
            self.router = "cache-aware" if self.data_parallel_size > 1 and self.enable_prefix_caching \
                else "least-loaded"
        elif self.router == "cache-aware" and not self.enable_prefix_caching:
            raise ConfigError("--router cache-aware routes by cached prefixes: it needs --enable-prefix-caching")
        if self.router != "cache-aware":
            tuned = [opts.BY_NAME[n].flag for n in ("router_balance_abs", "router_balance_rel")
                     if getattr(self, n) != opts.BY_NAME[n].default]
            if tuned:
                raise ConfigError(f"{', '.join(tuned)}: tune the cache-aware router, but the router is "
                                  f"{self.router} (cache-aware needs --enable-prefix-caching)")

    def _check_unread_options(self) -> None:
        if self.default_deadline_s is not None and self.scheduling_policy != "deadline":
            raise ConfigError("--default-deadline-s orders requests by deadline: it needs "
                              "--scheduling-policy deadline")
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ConfigError("--ray-address names a Ray cluster: it needs --distributed-executor-backend ray")
        if not self.disable_log_requests:
            raise ConfigError("--no-disable-log-requests: pagedserve never logs prompts or outputs")

    def _check_speculative_config(self) -> None:
        try:
            spec = parse_speculative_config(self.speculative_config)
            check_draft_model(spec, self.model, self.tensor_parallel_size)
        except SpeculativeConfigError as exc:
            raise ConfigError(str(exc)) from None
        if spec is not None and spec.model is not None:  # every child reads the same directory
            self.speculative_config = dataclasses.replace(spec, model=str(Path(spec.model).resolve())).to_json()

    def _check_memory_options(self) -> None:
        if self.gpu_memory_utilization is None:
            return
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

    def _child_cmd(self, process: str, run_dir: str, **overrides) -> list[str]:
        values = opts.values_of(self, opts.options_for(process)) | overrides
        return python_module(f"pagedserve.{process}_proc", "--run-dir", run_dir, "--model", self.model,
                             *opts.argv_for(process, values))

    def frontend_cmd(self, run_dir: str) -> list[str]:
        return self._child_cmd(FRONTEND, run_dir) + [a for alias in self.model_aliases for a in ("--model-alias", alias)]

    def trace_path(self, replica: int) -> Optional[str]:
        """Where ``replica``'s scheduler records, with --record-trace: PATH, or PATH.N with -dp > 1."""
        if not self.record_trace:
            return None
        return self.record_trace if self.data_parallel_size == 1 else f"{self.record_trace}.{replica}"

    def scheduler_cmd(self, run_dir: str, replica: int) -> list[str]:
        return self._child_cmd(SCHEDULER, run_dir, seed=self.seed + replica, record_trace=self.trace_path(replica)) + [
            "--replica", str(replica)]

    def worker_cmd(self, run_dir: str, replica: int, rank: int, dist_init: Optional[str]) -> list[str]:
        cmd = self._child_cmd(WORKER, run_dir, num_threads=self.threads_per_worker(),
                              gpu_memory_utilization=self.worker_memory_utilization()) + [
            "--replica", str(replica), "--rank", str(rank)]
        return cmd + (["--dist-init", dist_init] if dist_init else [])


def _lora_module(item: str, served: list[str]) -> tuple[str, str]:
    """(name, path) of one --lora-modules item; vLLM's JSON may also say the base_model_name, which
    must be this model's (a JSON key nothing reads is refused)."""
    name, path = opts.lora_module(item)
    if item.lstrip().startswith("{"):
        spec = json.loads(item)
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown:
            raise ConfigError(f"--lora-modules {name}: unknown key(s) {', '.join(unknown)} (vLLM's keys: name, "
                              f"path, base_model_name)")
        base = spec.get("base_model_name")
        if base is not None and base not in served:
            raise ConfigError(f"--lora-modules {name}: base_model_name {base!r} is not the served model "
                              f"({', '.join(served)})")
    return name, path


ServeConfig = opts.make_config(
    "ServeConfig", [("model", str), *opts.dataclass_fields(), ("extra", dict, dataclasses.field(default_factory=dict)),
                    ("model_aliases", Optional[list], None)],
    _ServeConfigRules)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory (config.json + safetensors); default: the demo model")
    opts.add_arguments(p)


def serve_config_from_args(ns: argparse.Namespace, model: str) -> ServeConfig:
    return ServeConfig(model=model, **{o.name: getattr(ns, o.name) for o in opts.OPTIONS})
