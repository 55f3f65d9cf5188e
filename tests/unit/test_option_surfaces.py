"""Every serve option is defined once (runtime/options.py), and every surface agrees with
that definition: the ``pagedserve serve`` CLI, ServeConfig and so ``LLM(...)``, and the
command line and config of each child process (pure objects: nothing is started)."""

from __future__ import annotations

import argparse
import inspect
import json

from pathlib import Path

import pytest

from pagedserve.deploy.cli import build_parser as serve_cli
from pagedserve.offline.llm import LLM
from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.frontend_proc.args import FrontendConfig, build_parser as frontend_cli, parse_args as frontend_args
from pagedserve.runtime import options as opts
from pagedserve.scheduler_proc.engine_config import EngineConfig
from pagedserve.worker_proc.__main__ import build_parser as worker_cli
from pagedserve.worker_proc.worker import WorkerConfig
from pagedserve.deploy.entry_points import arguments_of
from support.lora_files import write_adapter

# Values whose generic non-default (below) would break the option's own rule or another's.
SPECIAL = {"served_model_name": ["alias-a", "alias-b"], "chat_template": "{{ messages }}", "host": "127.0.0.2",
           "log_level": "DEBUG", "device": "cuda", "internal_host": None, "internal_port_base": None,
           "internal_curve": False, "remote_workers": False,
           # the two KV-cache budgets exclude each other; a generation config must exist
           "gpu_memory_utilization": 0.5, "generation_config": "vllm",
           "max_num_batched_tokens": 4096,  # at least the doubled max_num_seqs (512)
           # aging and a default deadline need the deadline policy; tenant weights need fair (below)
           "scheduling_policy": "deadline", "tenant_weights": None,
           "router": "cache-aware",  # tuned by --router-balance-*, needs --enable-prefix-caching (on)
           # the generating task, as the generation-only options need it (embed: its own tests)
           "task": "generate", "pooling_type": None, "pooler_config": None,
           "disable_log_requests": True,  # --no-disable-log-requests is refused
           "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
           # must name the checkpoint's own method, and this one is not quantized (its own tests:
           # tests/unit/test_quantized_models.py, down to the worker's command line)
           "quantization": None,
           # LoRA runs on the native families only; host memory holds at least --max-loras adapters;
           # --lora-modules names a real adapter directory (the model fixture writes it)
           "model_impl": "native", "max_cpu_loras": 16, "lora_modules": None,
           # this model is an HF directory: a GGUF's tokenizer option is refused for it (its own tests:
           # tests/unit/test_gguf_models.py)
           "load_format": "safetensors", "tokenizer": None,
           # this model is dense: expert parallelism is refused for it (its own tests, down to the
           # workers' placement: tests/e2e/test_expert_parallel.py)
           "enable_expert_parallel": False}
NEEDS_ANOTHER_POLICY = ("tenant_weights",)
AT_DEFAULT = (*NEEDS_ANOTHER_POLICY, "task", "pooling_type", "pooler_config", "disable_log_requests", "quantization",
              "enable_expert_parallel")
KV_BUDGETS = ("gpu_memory_utilization", "kv_cache_memory_gib")  # exclude each other: one at a time
OFFLINE_DEFAULTS = {"log_level": "WARNING"}  # LLM is quiet unless asked; the only default it changes


def non_default(option: opts.Option):
    """A valid value of ``option`` that is not its default."""
    if option.name in SPECIAL:
        return SPECIAL[option.name]
    if option.type is bool:
        return not option.default
    if option.choices:
        return next(c for c in reversed(option.choices) if c != option.default)
    if option.type is int:
        return option.default * 2 if option.default else 4
    if option.type is float:
        return option.default * 2 if option.default else 2.0
    return "some-value"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                  "max_position_embeddings": 512, "torch_dtype": "float32",
                                                  "hidden_size": 32, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "intermediate_size": 64,
                                                  "num_hidden_layers": 2}))
    adapter = write_adapter(path / "adapter", path, r=8)
    SPECIAL["lora_modules"] = [f"tiny-adapter={Path(adapter).resolve()}"]  # as ServeConfig resolves it
    return str(path)


def scheduler_cli() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return p


def test_every_option_is_a_serve_flag_and_a_config_field_with_the_tables_default(model):
    ns = serve_cli().parse_args(["serve", model])
    fields = {name: f.default for name, f in ServeConfig.__dataclass_fields__.items()}
    for option in opts.OPTIONS:
        assert getattr(ns, option.name) == option.default, option.flag
        assert fields[option.name] == option.default, option.name
    help_text = serve_cli()._subparsers._group_actions[0].choices["serve"].format_help()
    assert all(o.flag in help_text for o in opts.OPTIONS if not o.hidden)


def test_every_option_reaches_llm_with_the_same_default(model):
    params = inspect.signature(LLM.__init__).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())  # the rest go to ServeConfig
    for option in opts.OPTIONS:
        if option.name in params:
            assert params[option.name].default == OFFLINE_DEFAULTS.get(option.name, option.default), option.name
    given = {o.name: non_default(o) for o in opts.OPTIONS if o.name not in ("dtype", "kv_cache_memory_gib")}
    cfg = ServeConfig(model=model, **given)
    assert all(getattr(cfg, name) == value for name, value in given.items() if name != "chat_template")


@pytest.mark.parametrize("process, cli", [(opts.SCHEDULER, scheduler_cli), (opts.WORKER, worker_cli),
                                          (opts.FRONTEND, frontend_cli)])
def test_each_child_process_parses_its_options_with_the_tables_defaults(process, cli):
    ns = cli().parse_args(["--run-dir", "r", "--model", "m"])
    for option in opts.options_for(process):
        assert getattr(ns, option.name) == option.default, f"{process} {option.flag}"


@pytest.mark.parametrize("budget", KV_BUDGETS)
def test_each_child_is_started_with_exactly_the_values_serve_was_given(model, budget):
    unset = next(b for b in KV_BUDGETS if b != budget)
    changed = {o.name: non_default(o) for o in opts.OPTIONS} | {unset: None}
    cfg = ServeConfig(model=model, **changed)
    for o in opts.options_for(opts.SCHEDULER) + opts.options_for(opts.WORKER) + opts.options_for(opts.FRONTEND):
        assert getattr(cfg, o.name) != o.default or o.name in ("dtype", unset, *AT_DEFAULT), \
            f"{o.flag} kept its default"

    engine = EngineConfig.from_args(scheduler_cli().parse_args(arguments_of(cfg.scheduler_cmd("run", replica=1))))
    expected = opts.values_of(cfg, opts.options_for(opts.SCHEDULER))
    expected.update(seed=cfg.seed + 1, record_trace=f"{cfg.record_trace}.1")  # per replica
    assert opts.values_of(engine, opts.options_for(opts.SCHEDULER)) == expected and engine.replica == 1

    ns = worker_cli().parse_args(arguments_of(cfg.worker_cmd("run", replica=1, rank=1, dist_init="tcp://127.0.0.1:1")))
    worker = WorkerConfig(**{name: getattr(ns, name) for name in WorkerConfig.__dataclass_fields__})
    assert opts.values_of(worker, opts.options_for(opts.WORKER)) == opts.values_of(cfg, opts.options_for(opts.WORKER))
    assert (worker.replica, worker.rank, worker.dist_init) == (1, 1, "tcp://127.0.0.1:1")

    frontend = frontend_args(arguments_of(cfg.frontend_cmd("run")))
    expected = opts.values_of(cfg, opts.options_for(opts.FRONTEND))
    expected.update(served_model_name=tuple(cfg.served_model_name), log_level=cfg.log_level.lower())
    assert opts.values_of(frontend, opts.options_for(opts.FRONTEND)) == expected
    assert isinstance(frontend, FrontendConfig) and frontend.num_replicas == cfg.data_parallel_size


@pytest.mark.parametrize("name, bad, complaint", [
    ("block_size", 12, "--block-size must be a power of two"),
    ("max_num_seqs", 0, "--max-num-seqs must be at least 1"),
    ("swap_space", -1.0, "--swap-space must be at least 0"),
    ("max_model_len", 1, "--max-model-len must be at least 2"),
    ("preemption_mode", "never", "--preemption-mode must be one of auto, swap, recompute"),
])
def test_one_rule_per_option_whichever_process_checks_it(model, name, bad, complaint):
    with pytest.raises(ConfigError, match=complaint):
        ServeConfig(model=model, **{name: bad})
    with pytest.raises(ValueError, match=complaint):
        EngineConfig(run_dir="r", **{name: bad})


def test_tenant_weights_reach_the_scheduler_inline_from_a_flag_or_a_file(model, tmp_path):
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({"gold": 4, "free": 0.5}))
    for given, inline in (("gold=4,free=0.5", "free=0.5,gold=4.0"), (str(weights), "free=0.5,gold=4.0")):
        cfg = ServeConfig(model=model, scheduling_policy="fair", tenant_weights=given)
        engine = EngineConfig.from_args(scheduler_cli().parse_args(arguments_of(cfg.scheduler_cmd("run", replica=0))))
        assert engine.tenant_weights == inline  # what a trace records: no file needed to replay
    with pytest.raises((ConfigError, ValueError), match="tenant-weights"):
        ServeConfig(model=model, scheduling_policy="fair", tenant_weights="gold=-1")


# Options accepted and then ignored are refused, in one line naming the flag, before anything starts.
@pytest.mark.parametrize("given, complaint", [
    (dict(max_model_len=1024), r"--max-model-len: User-specified max_model_len \(1024\) is greater than the "
                               r"derived max_model_len \(max_position_embeddings=512"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
     r"--max-num-batched-tokens \(256\) is smaller than --max-model-len \(512\)"),
    (dict(router="cache-aware", data_parallel_size=2), "--router cache-aware .* needs --enable-prefix-caching"),
    (dict(router_balance_abs=5, data_parallel_size=2), "--router-balance-abs: .* router is least-loaded"),
    (dict(router_balance_rel=2.0, router="round-robin"), "--router-balance-rel: .* router is round-robin"),
    (dict(task="embed", reasoning_parser="qwen3"), "--reasoning-parser: generation only"),
    (dict(task="embed", enable_auto_tool_choice=True, tool_call_parser="hermes"),
     "--enable-auto-tool-choice, --tool-call-parser: generation only"),
    (dict(task="embed", max_logprobs=5), "--max-logprobs: generation only"),
    (dict(task="embed", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'),
     "--speculative-config: generation only"),
    (dict(task="embed", chat_template="{{ messages }}"), "--chat-template: generation only"),
    (dict(task="embed", generation_config="vllm"), "--generation-config: generation only"),
    (dict(default_deadline_s=5.0), "--default-deadline-s .* needs --scheduling-policy deadline"),
    (dict(default_deadline_s=5.0, scheduling_policy="priority"), "--default-deadline-s"),
    (dict(ray_address="auto"), "--ray-address .* needs --distributed-executor-backend ray"),
    (dict(disable_log_requests=False), "--no-disable-log-requests"),
    (dict(tool_call_parser="hermes"), "--tool-call-parser .* needs --enable-auto-tool-choice"),
])
def test_an_option_that_would_be_ignored_is_refused_naming_it(model, given, complaint):
    with pytest.raises(ConfigError, match=complaint):
        ServeConfig(model=model, **given)


def test_the_refused_options_are_accepted_where_they_are_read(model, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's override, by its own name
    assert ServeConfig(model=model, max_model_len=1024).max_model_len == 1024
    monkeypatch.delenv("PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN")
    assert ServeConfig(model=model, max_model_len=512).max_model_len == 512
    unchunked = ServeConfig(model=model, enable_chunked_prefill=False, max_num_batched_tokens=512)
    assert unchunked.max_num_batched_tokens == 512
    assert ServeConfig(model=model, enable_chunked_prefill=False, max_num_batched_tokens=None,
                       device="cpu").max_num_batched_tokens >= 512
    cfg = ServeConfig(model=model, router="cache-aware", enable_prefix_caching=True, router_balance_abs=5,
                      data_parallel_size=2, scheduling_policy="deadline", default_deadline_s=5.0,
                      distributed_executor_backend="ray", ray_address="auto")
    assert (cfg.router, cfg.router_balance_abs, cfg.default_deadline_s) == ("cache-aware", 5, 5.0)
    embed = ServeConfig(model=model, task="embed", max_logprobs=opts.BY_NAME["max_logprobs"].default)
    assert embed.task == "embed" and embed.speculative_config is None


def test_the_default_router_is_cache_aware_only_with_a_prefix_cache_to_route_by(model):
    assert ServeConfig(model=model, data_parallel_size=2).router == "least-loaded"
    assert ServeConfig(model=model, data_parallel_size=2, enable_prefix_caching=True).router == "cache-aware"
    assert ServeConfig(model=model, enable_prefix_caching=True).router == "least-loaded"


def test_a_budget_left_unset_without_chunked_prefill_still_holds_the_longest_prompt(model, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                      "max_position_embeddings": 4096}))
    cfg = ServeConfig(model=str(tmp_path), device="cpu", enable_chunked_prefill=False)
    assert cfg.max_num_batched_tokens == 4096 > opts.CPU_STEP_TOKENS


def test_without_a_default_deadline_given_the_deadline_policy_keeps_sixty_seconds(model):
    cfg = ServeConfig(model=model, scheduling_policy="deadline")
    engine = EngineConfig.from_args(scheduler_cli().parse_args(arguments_of(cfg.scheduler_cmd("run", replica=0))))
    assert engine.default_deadline_s is None
    assert engine.scheduler_config(num_gpu_blocks=8, num_cpu_blocks=0).default_deadline_s == 60.0


@pytest.mark.parametrize("level, uvicorn", [("warn", "warning"), ("FATAL", "critical"), ("notset", "debug"),
                                            ("WARNING", "warning"), ("debug", "debug")])
def test_every_log_level_serve_accepts_reaches_the_frontend_as_one_uvicorn_knows(model, level, uvicorn):
    cfg = ServeConfig(model=model, log_level=level)
    frontend = frontend_args(arguments_of(cfg.frontend_cmd("run")))
    assert frontend.log_level == uvicorn and uvicorn in opts.UVICORN_LOG_LEVELS


def test_swap_space_is_documented_per_worker_as_each_tensor_parallel_worker_allocates_it():
    assert "per worker" in opts.BY_NAME["swap_space"].help and "per replica" not in opts.BY_NAME["swap_space"].help
