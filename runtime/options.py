"""Every serve option, defined once: name, type, default, check, help, and which child
process is started with it.

The ``pagedserve serve`` CLI, ServeConfig (and so the offline ``LLM(...)`` keywords), the
scheduler's EngineConfig, the worker's WorkerConfig and the frontend's FrontendConfig all
derive their flags, fields, defaults and checks from OPTIONS; the supervisor renders each
child's command line from the same entries (``argv_for``), so a flag has one spelling in
every process. Adding an option is one entry here (docs/CONTRIBUTING.md, "Adding an option").
Cross-option rules (``--internal-curve`` needs ``--internal-host``) stay with the config that
sees both options; an entry's ``check`` is about its own value only.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from pagedserve.protocol.gguf_file import LOAD_FORMATS
from pagedserve.protocol.quantization import METHODS as QUANTIZATION_METHODS
from pagedserve.protocol.priority import MAX_LIMIT_S, SCHEDULING_POLICIES, parse_tenant_weights
from pagedserve.protocol.speculative import SpeculativeConfigError, parse_speculative_config

# The processes a serve option can be handed to (the supervisor keeps every option).
SCHEDULER, WORKER, FRONTEND = "scheduler", "worker", "frontend"

DTYPE_ALIASES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
                 "float16": "float16", "half": "float16"}
DTYPE_CHOICES = ("auto", *DTYPE_ALIASES)
ROUTER_KINDS = ("cache-aware", "least-loaded", "round-robin")  # client/routing_policy.py
PREEMPTION_MODES = ("auto", "swap", "recompute")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "qwen3_coder")  # frontend_proc/tool_parsers/ (a test checks)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # frontend_proc/reasoning/__init__.py (a test checks)
TASKS = ("generate", "embed")
POOLING_TYPES = ("last", "mean")  # protocol/pooling.py
MODEL_IMPLS = ("auto", "native", "transformers")  # worker_proc/model_impl.py
# vLLM's spellings of a task: --runner generate|pooling|auto (auto: a decoder generates)
_TASK_NAMES = {"generate": "generate", "auto": "generate", "embed": "embed", "embedding": "embed",
               "pooling": "embed"}
BACKENDS = ("mp", "ray")  # vLLM's names for --distributed-executor-backend
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# logging's other names for --log-level, in uvicorn's words (uvicorn refuses warn, fatal, notset);
# notset is debug, not trace: logging, which the frontend configures with it too, has no trace.
_UVICORN_NAMES = {"warn": "warning", "fatal": "critical", "notset": "debug"}


class OptionError(ValueError):
    """An option value that cannot work; the message names the flag and says why."""


def _positive(v) -> bool:
    return v >= 1


def _non_negative(v) -> bool:
    return v >= 0


def _power_of_two(v) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _speculative_config(v) -> bool:
    try:
        parse_speculative_config(v)
    except SpeculativeConfigError as exc:
        raise OptionError(str(exc)) from None  # its own one line, not the generic "must be"
    return True


def task_name(value: str) -> str:
    """``--task`` / ``--runner``'s value in pagedserve's words (vLLM's ``pooling`` is ``embed``)."""
    return _TASK_NAMES.get(str(value).strip().lower(), value)


def _log_level(v) -> bool:
    return isinstance(logging.getLevelName(str(v).upper()), int)


def uvicorn_log_level(level: str) -> str:
    """``--log-level`` (any of logging's names) as uvicorn and logging both accept it."""
    name = str(level).lower()
    return _UVICORN_NAMES.get(name, name)


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the config field; the flag is --name-with-dashes
    type: type  # int | float | str | bool; with nargs="+" the type of one item
    default: Any
    help: str
    check: Optional[tuple[Callable[[Any], bool], str]] = None  # (rule, "must be ...") on a non-None value
    choices: Optional[tuple] = None
    to: frozenset = frozenset()  # the child processes started with it
    aliases: tuple[str, ...] = ()
    nargs: Optional[str] = None
    metavar: Optional[str] = None
    hidden: bool = False  # accepted but not in --help (debug switches)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def validate(self, value: Any) -> None:
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"{self.flag} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.check is not None and not self.check[0](value):
            raise OptionError(f"{self.flag} {self.check[1]}, got {value!r}")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        kwargs: dict[str, Any] = {"default": self.default, "dest": self.name,
                                  "help": argparse.SUPPRESS if self.hidden else self.help}
        if self.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=self.type, nargs=self.nargs, metavar=self.metavar, choices=self.choices)
        parser.add_argument(self.flag, *self.aliases, **kwargs)

    def argv(self, value: Any) -> list[str]:
        """This option as a child's command line: nothing for None (the child's default)."""
        if value is None:
            return []
        if self.type is bool:
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.nargs:
            return [self.flag, *map(str, value)]
        return [self.flag, str(value)]


def _lora_modules_ok(v) -> bool:
    try:
        return all(lora_module(item) for item in v)
    except ValueError:
        return False


def lora_module(item: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules item: NAME=PATH or vLLM's JSON with name and path."""
    if item.lstrip().startswith("{"):
        try:
            spec = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {item!r}: {exc}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError(f"--lora-modules {item!r}: JSON needs string name and path")
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {item!r} is not NAME=PATH")
    if not name or not path:
        raise ValueError(f"--lora-modules {item!r}: empty name or path")
    return name, path


def _tenant_weights_ok(v) -> bool:
    try:
        parse_tenant_weights(v)
    except ValueError:
        return False
    return True


_S, _W, _F = frozenset({SCHEDULER}), frozenset({WORKER}), frozenset({FRONTEND})
_POSITIVE = (_positive, "must be at least 1")
_NON_NEGATIVE = (_non_negative, "must be at least 0")
_POSITIVE_S = (lambda v: v > 0, "must be positive")

OPTIONS: tuple[Option, ...] = (
    # -- HTTP
    Option("host", str, "127.0.0.1", "the HTTP server's address", to=_F),
    Option("port", int, 8000, "the HTTP server's port", (lambda v: 0 <= v <= 65535, "is not a TCP port (0..65535)"),
           to=_F),
    Option("served_model_name", str, None, "names clients may use for the model; responses carry the "
           "first (default: the model directory's name)", nargs="+", metavar="NAME", to=_F),
    Option("api_key", str, None, "require 'Authorization: Bearer KEY' on every endpoint but /health", to=_F),
    Option("chat_template", str, None, "a Jinja chat template (a file, or the template text) instead of "
           "the model's", metavar="FILE_OR_TEMPLATE", to=_F),
    Option("max_logprobs", int, 20, "most logprobs alternatives per token a request may ask for "
           "(larger: 400)", _NON_NEGATIVE, to=_F),
    Option("replica_timeout_s", float, 5.0, "a replica whose last stats are older than this is down",
           _POSITIVE_S, to=_F),
    Option("drain_timeout_s", float, 30.0, "on SIGTERM, how long in-flight requests may take to finish",
           _NON_NEGATIVE, to=_F),
    Option("uvicorn_log_level", str.lower, None, "the HTTP server's log level (default: --log-level)",
           choices=UVICORN_LOG_LEVELS, to=_F),
    Option("generation_config", str, "auto", "default sampling for request fields left out: auto = the "
           "model dir's generation_config.json, a directory = its generation_config.json, vllm = none "
           "(vLLM's own defaults)", metavar="auto|vllm|DIR", to=_F),
    Option("enable_auto_tool_choice", bool, False, 'let requests use tool_choice "auto": tool calls are '
           "parsed from the output by --tool-call-parser", to=_F),
    Option("tool_call_parser", str, None, "how tool calls are written in the model's output (hermes: "
           "Qwen2.5, Qwen3 and Hermes models; llama3_json: Llama 3.1+; pythonic: Llama 3.2 / 4 and others "
           "writing [f(x=1)]; qwen3_coder: Qwen3-Coder's <function=...> blocks)", choices=TOOL_CALL_PARSERS,
           metavar="NAME", to=_F),
    Option("reasoning_parser", str, None, "split the thinking between <think> and </think> from the "
           "answer into reasoning_content (qwen3: Qwen3 and Qwen3.5, honours enable_thinking; "
           "deepseek_r1: DeepSeek-R1 and its distills)", choices=REASONING_PARSERS, metavar="NAME", to=_F),
    Option("task", task_name, "generate", "generate: /v1/completions and chat; embed (vLLM's --runner "
           "pooling): /v1/embeddings, the model's final hidden states pooled", choices=TASKS,
           aliases=("--runner",), to=_F),
    Option("pooling_type", str.lower, None, "--task embed: pool the last token's hidden state or the mean "
           "of all (default: --pooler-config's, else last)", choices=POOLING_TYPES, to=_F),
    Option("pooler_config", str, None, "--task embed, vLLM's JSON: {\"pooling_type\": \"LAST\"|\"MEAN\", "
           "\"normalize\": true|false}", aliases=("--override-pooler-config",), metavar="JSON", to=_F),
    Option("disable_log_requests", bool, True, "accepted for vLLM command lines: pagedserve never logs "
           "prompts or outputs, so --no-disable-log-requests is refused"),
    # -- model and devices
    Option("device", str, "auto", "cpu, cuda, or auto: cuda when torch sees a GPU, else cpu", to=_W),
    Option("model_impl", str, "auto", "which implementation runs the model: native (pagedserve's own "
           "families), transformers (transformers' modeling code over the paged cache, any decoder-only causal LM "
           "it knows; one device), or auto: native where pagedserve has the family, else transformers",
           choices=MODEL_IMPLS, to=_W),
    Option("enforce_eager", bool, False, "never use CUDA graphs: launch every decode step's kernels one "
           "by one (slower on a GPU; no effect on CPU)", to=_W),
    Option("dtype", str, "auto", "weights and KV cache; auto: the model config's dtype, but on CPU a "
           "float16 or bfloat16 model computes in bfloat16 where oneDNN has it (AVX-512 and up), else in "
           "float32 if that fits half the free memory", choices=DTYPE_CHOICES, to=_W),
    Option("kv_cache_dtype", str, "auto", "the KV cache's dtype: auto (--dtype's), or fp8 / fp8_e4m3: float8 e4m3 "
           "by a saturating cast (per-tensor scales of 1.0, vLLM's default), half a 16-bit cache's bytes; a GPU's "
           "Triton attention only, native families without a latent cache", choices=("auto", "fp8", "fp8_e4m3"),
           to=_W),
    Option("quantization", str, None, "the checkpoint's quantization method, read from its config.json's "
           "quantization_config (compressed-tensors: int4 / int8 weights, W8A8, FP8; gptq: 4 / 8 bits; awq: "
           "4-bit GEMM); given, it must match the checkpoint's (default: the checkpoint's)", choices=QUANTIZATION_METHODS, aliases=("-q",), to=_W),
    Option("load_format", str, "auto", "the model's format: safetensors (an HF directory), gguf (a .gguf file, or a "
           "directory holding one: architecture, hyperparameters and tokenizer from its metadata; Q8_0 / Q4_0 "
           "run as int8 / int4 weights, other quantized types dequantized at load), or auto: gguf for a .gguf "
           "file or a directory of one without config.json", choices=LOAD_FORMATS),
    Option("tokenizer", str, None, "a GGUF model's tokenizer: this HF directory's instead of the one in the "
           "file's metadata", metavar="DIR"),
    Option("max_model_len", int, None, "prompt + output token limit (default: the model's "
           "max_position_embeddings)", (lambda v: v >= 2, "must be at least 2"), to=_S | _F),
    Option("tensor_parallel_size", int, 1, "workers (devices) per replica", _POSITIVE,
           to=_S | _W, aliases=("-tp",)),
    Option("enable_expert_parallel", bool, False, "a mixture of experts' routed experts placed whole on the "
           "tensor-parallel ranks (each holds experts/tp of them; --tensor-parallel-size must divide the experts) "
           "instead of a slice of every expert on each", to=_W),
    Option("data_parallel_size", int, 1, "replicas (a scheduler and its workers each)", _POSITIVE,
           to=_F, aliases=("-dp",)),
    Option("num_threads", int, None, "CPU threads per worker", _POSITIVE, to=_W),
    # -- KV cache
    Option("block_size", int, 16, "tokens per KV block", (_power_of_two, "must be a power of two"),
           to=_S | _W),
    Option("num_gpu_blocks", int, None, "KV blocks per device (default: as many as fit)", _POSITIVE, to=_S),
    Option("kv_cache_memory_gib", float, None, "memory budget for the KV cache per device", _POSITIVE_S,
           to=_W),
    Option("gpu_memory_utilization", float, None, "vLLM's: on CUDA the share of each device's memory the "
           "deployment may fill (weights included; the KV cache takes what is left); on CPU the share of "
           "RAM the KV caches may take (default: 90%% of free CUDA memory, 1 GiB on CPU)",
           (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"), metavar="FRACTION", to=_W),
    Option("swap_space", float, 1.0, "host swap space per worker (device), GiB, as vLLM's: each "
           "tensor-parallel worker holds its own", _NON_NEGATIVE, to=_S),
    Option("enable_prefix_caching", bool, False, "reuse the KV blocks of prompt prefixes already computed",
           to=_S),
    Option("poison_kv_cache", bool, False, "debug: fill the KV cache with NaN at start", to=_W, hidden=True),
    # -- scheduling
    Option("max_num_seqs", int, 256, "most sequences running at once per replica", _POSITIVE, to=_S),
    Option("max_num_batched_tokens", int, None, "most tokens computed in one step (default: 1024 on CPU, "
           "where a step's cost grows with its tokens and smaller steps let first tokens out sooner; "
           "8192 on CUDA, vLLM's, where launching a step's kernels costs the host more than the GPU "
           "spends on 2048 tokens)", _POSITIVE, to=_S),
    Option("enable_chunked_prefill", bool, True, "split long prompts over steps", to=_S),
    Option("preemption_mode", str, "auto", "how a preempted sequence gives its blocks back",
           choices=PREEMPTION_MODES, to=_S),
    Option("scheduling_policy", str, "fcfs", "fcfs: first come, first served (a request's non-zero "
           "priority is refused); priority: lower priority values run first, a waiting request preempts "
           "running ones of a lower priority, and within one priority first come, first served; deadline: "
           "as priority, but within one priority the earliest deadline first (a request without one: "
           "arrival + --default-deadline-s, so FCFS); fair: each tenant's share of tokens is kept even "
           "(virtual token counters, Sheng et al. OSDI '24): the waiting request of the tenant served "
           "least starts next", choices=SCHEDULING_POLICIES, to=_S | _F),
    Option("priority_aging_s", float, None, "priority and deadline policies: lift a request one priority level for every "
           "this many seconds since it arrived, so that low priority cannot starve forever (default: off, "
           "a request keeps its priority for its whole life and a steady flow of higher-priority requests "
           "can hold it back indefinitely)", _POSITIVE_S, metavar="SECONDS", to=_S),
    Option("max_queue_time_s", float, None, "most seconds a request may wait for its first token "
           "(a request's max_queue_time_s may ask for less); past it the request ends with an error (HTTP "
           "503 with Retry-After before streaming, an abort chunk and an error event after; offline "
           "finish_reason \"error\") (default: no limit)", (lambda v: 0 < v <= MAX_LIMIT_S, "must be positive"),
           metavar="SECONDS", to=_S),
    Option("default_deadline_s", float, None, "deadline policy: the deadline a request without one gets, "
           "counted from its arrival (it only orders requests; nothing ends at it) (default: 60)", _POSITIVE_S,
           metavar="SECONDS", to=_S),
    Option("tenant_header", str, None, "the HTTP header that names a request's tenant (fair policy and "
           "per-tenant metrics); it wins over the request's user field, which wins over the API key",
           metavar="NAME", to=_F),
    Option("tenant_weights", str, None, "fair policy: each tenant's weight, NAME=WEIGHT[,NAME=WEIGHT...] or a "
           "JSON file of {name: weight}; a tenant with weight 2 gets twice the tokens of one with 1 (default: "
           "every tenant 1)", (_tenant_weights_ok, "must be NAME=WEIGHT,... with positive weights, or a JSON "
           "file of them"), metavar="WEIGHTS|FILE", to=_S),
    Option("max_waiting_requests", int, None, "load shedding: most requests waiting for a seat per "
           "replica; a request whose replica is full goes to another with room, and when every replica is "
           "full it is refused at once (HTTP 429 with Retry-After); nothing already admitted is affected "
           "(default: no limit). Serve only: the offline LLM refuses it, as generate() hands the engine "
           "its whole batch at once", _NON_NEGATIVE,
           metavar="N", to=_S | _F),
    Option("async_scheduling", bool, True, "schedule the next step while the workers run this one "
           "(--no-async-scheduling waits for every step's result before the next)", to=_S),
    Option("speculative_config", str, None, "vLLM's JSON: speculative decoding by prompt lookup, e.g. "
           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
           "\"prompt_lookup_min\": 2}', or by a smaller model of the same vocabulary, '{\"method\": "
           "\"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}'; greedy outputs stay the same "
           "and sampled ones keep their distribution (docs/DECISIONS.md); eagle and mtp are refused",
           (_speculative_config, "is not a speculative config"), metavar="JSON", to=_S | _W),
    # -- LoRA adapters (protocol/lora_adapter.py reads them)
    Option("enable_lora", bool, False, "serve LoRA adapters of the base model: a request's model field names "
           "the adapter (--lora-modules, or POST /v1/load_lora_adapter when "
           "PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)", to=_S | _W | _F),
    Option("lora_modules", str, None, "adapters served from the start, each NAME=PATH (a PEFT directory) or "
           "vLLM's JSON '{\"name\": NAME, \"path\": PATH}'", (_lora_modules_ok, "must be NAME=PATH or "
           "JSON with name and path"), nargs="+", metavar="NAME=PATH", to=_F),
    Option("max_loras", int, 4, "most different adapters in one step (each holds a slot of adapter weights "
           "on every worker); a request of another adapter waits, FCFS, until a slot frees (vLLM's default "
           "is 1, which serialises a mix of adapters)", _POSITIVE, to=_S | _W),
    Option("max_lora_rank", int, 16, "the largest adapter rank served; a slot is sized for it", _POSITIVE,
           to=_W | _F),
    Option("max_cpu_loras", int, None, "adapters each worker keeps read in host memory, least recently used "
           "dropped first, so a slot loads from memory, not disk (default: --max-loras, and never fewer)",
           _POSITIVE, to=_W),
    Option("seed", int, 0, "sampling seed (replica r uses seed + r)", to=_S),
    Option("debug_invariants", bool, False, "check block-manager invariants every step", to=_S),
    Option("record_trace", str, None, "record the protocol to a trace file (replica r of several: "
           "PATH.r)", metavar="PATH", to=_S),
    Option("step_timeout_s", float, 60.0, "a step slower than this is a hung worker", _POSITIVE_S, to=_S),
    # -- routing over replicas
    Option("router", str, None, "how requests are spread over data-parallel replicas: cache-aware sends "
           "each to the replica holding the longest cached prefix of its prompt (needs "
           "--enable-prefix-caching), unless it is busier than the load bound allows, then to the least "
           "loaded; least-loaded; round-robin (default: cache-aware when --data-parallel-size > 1 and "
           "--enable-prefix-caching, else least-loaded; "
           "docs/DECISIONS.md)", choices=ROUTER_KINDS, to=_F),
    Option("router_balance_abs", int, 2, "cache-aware: the cache winner may carry this many more "
           "sequences than the least-loaded replica (default %(default)s)", _NON_NEGATIVE, to=_F),
    Option("router_balance_rel", float, 1.25, "cache-aware: ... or up to this many times its load "
           "(default %(default)s)", (lambda v: v >= 1.0, "must be at least 1.0"), to=_F),
    # -- supervision
    Option("scheduler_timeout_s", float, 30.0, "a scheduler silent for this long (alive but no "
           "heartbeat) is hung and restarted", _POSITIVE_S),
    Option("max_restarts", int, 5, "restarts of a process within --restart-window-s before serve gives up",
           _NON_NEGATIVE),
    Option("restart_window_s", float, 300.0, "the window --max-restarts counts in", _POSITIVE_S),
    Option("run_dir_parent", str, None, "where the private 0700 run directory is created"),
    Option("log_level", str, "INFO", "log level of every process", (_log_level, "is not a log level"),
           to=_S | _W | _F),
    # -- beyond one node (deploy/README.md)
    Option("internal_host", str, None, "put the internal ZMQ endpoints on TCP at this IP (default: ipc "
           "sockets in the private run dir); CurveZMQ is required unless it is a loopback address",
           metavar="HOST"),
    Option("internal_port_base", int, None, "internal endpoint k listens on PORT+k; uses 2 + 2 x DP ports",
           (lambda v: 1 <= v <= 65535, "is not a TCP port"), metavar="PORT"),
    Option("internal_curve", bool, False, "encrypt and authenticate the internal TCP endpoints with "
           "CurveZMQ even on loopback"),
    Option("remote_workers", bool, False, "start no workers; write their command lines to "
           "RUN_DIR/worker-commands.sh for the operator to run (on this or another node)"),
    Option("distributed_executor_backend", str, "mp", "mp: every process on this node; ray: each replica "
           "placed on a Ray cluster node (pip install -e \".[ray]\")", choices=BACKENDS),
    Option("ray_address", str, None, "the Ray cluster to join (default: $RAY_ADDRESS, else a local "
           "ray.init())", metavar="ADDRESS"),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def options_for(process: Optional[str] = None) -> list[Option]:
    """Every option (None), or those a child process is started with."""
    return [o for o in OPTIONS if process is None or process in o.to]


def add_arguments(parser: argparse.ArgumentParser, process: Optional[str] = None) -> None:
    for option in options_for(process):
        option.add_to(parser)


def validate(values: dict) -> None:
    """Each option's own check on the values given (OptionError names the first bad one)."""
    for name, value in values.items():
        if name in BY_NAME:
            BY_NAME[name].validate(value)


def argv_for(process: str, values: dict) -> list[str]:
    """The flags of ``process``'s options with these values, for its command line."""
    return [arg for o in options_for(process) for arg in o.argv(values[o.name])]


def dataclass_fields(process: Optional[str] = None) -> list[tuple]:
    """(name, type, field) of these options, for ``dataclasses.make_dataclass``."""
    out = []
    for o in options_for(process):
        default = list(o.default) if isinstance(o.default, (list, tuple)) else o.default
        out.append((o.name, Any, dataclasses.field(default=default)))
    return out


def make_config(name: str, fields: list, rules: type, frozen: bool = False) -> type:
    """A dataclass whose fields are ``fields`` (option fields from ``dataclass_fields``
    among them) and whose methods come from ``rules`` (its ``__post_init__`` included)."""
    cls = dataclasses.make_dataclass(name, fields, bases=(rules,), frozen=frozen)
    cls.__module__ = rules.__module__
    return cls


def values_of(config: Any, options: Iterable[Option]) -> dict:
    return {o.name: getattr(config, o.name) for o in options}


CPU_STEP_TOKENS, CUDA_STEP_TOKENS = 1024, 8192


def default_step_tokens(device: str) -> int:
    """--max-num-batched-tokens when not given. On CUDA a step's host cost hardly grows with
    its tokens (bench/log/2026-11-25.md, H100), so larger steps prefill faster at little cost to
    decodes. On CPU a step's cost is nearly linear in its tokens, so a smaller step costs
    little throughput and lets the first requests of a burst out a step sooner: 2 cores,
    64 streams, TTFT p50 65-71 ms at 1024 against 88-92 ms at 2048, same tok/s (bench/log/2026-11-25.md)."""
    return CUDA_STEP_TOKENS if device.startswith("cuda") else CPU_STEP_TOKENS


# A GPU torch could use shows one of these: NVIDIA's driver and devices (a container may hold
# only /dev/nvidia3), WSL2's GPU bridge, ROCm's KFD.
GPU_DEVICE_PATTERNS = ("/proc/driver/nvidia/version", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def resolve_device(requested: str) -> str:
    """``auto`` is CUDA when this process's torch sees a GPU, as a vLLM user expects; else CPU.
    Where no GPU driver shows at all, that is CPU without importing torch: the import took
    1.5-3 s of every ``serve`` start before any child was spawned."""
    name = requested.strip().lower()
    if name == "auto":
        if not any(glob.glob(pattern) for pattern in GPU_DEVICE_PATTERNS):
            return "cpu"
        import torch  # deferred: option parsing alone must not pay for importing torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu" or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise OptionError(f"--device must be auto, cpu, cuda or cuda:N, got {requested!r}")


def resolve_dtype(requested: str, model_config: dict, device: str, model_dir: Optional[str] = None,
                  copies: int = 1) -> str:
    """``auto`` takes the model's own dtype, except for a half-precision checkpoint on a CPU:
    bfloat16 where oneDNN multiplies it, else float32 if it fits (runtime/cpu_dtype.py); a GGUF whose
    matrices are all integer blocks keeps its half type on any CPU.
    ``model_dir`` (for the checkpoint's size) and ``copies`` (replicas on this host) matter
    only there."""
    if requested != "auto":
        return DTYPE_ALIASES[requested]
    name = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32")
    name = DTYPE_ALIASES.get(name.removeprefix("torch."), "float32")
    if name != "float32" and device == "cpu" and (model_config.get("pagedserve_gguf") or {}).get("integer_matrices"):
        # every matrix multiplies on the integer kernels, not oneDNN's bfloat16: float32 would only make each
        # call of a Q8_0, Q5_0 or Q6_K layer dequantize its weight first (transformers' float32 products)
        logging.getLogger("pagedserve.dtype").info("--dtype auto: a GGUF's %s, its matrices all on the integer kernels",
                                                   name)
        return name
    if name != "float32" and device == "cpu":
        from pagedserve.runtime.cpu_dtype import cpu_dtype_for_half_checkpoint

        return cpu_dtype_for_half_checkpoint(name, model_dir or "", copies)
    return name
