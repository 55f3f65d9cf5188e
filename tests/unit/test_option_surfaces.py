"""Every serve option is defined once (protocol/options.py), and every surface agrees with
that definition: the ``pagedserve serve`` CLI, ServeConfig and so ``LLM(...)``, and the
command line and config of each child process (pure objects: nothing is started)."""

from __future__ import annotations

import argparse
import inspect
import json

import pytest

from pagedserve.deploy.cli import build_parser as serve_cli
from pagedserve.offline.llm import LLM
from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.frontend_proc.args import FrontendConfig, build_parser as frontend_cli, parse_args as frontend_args
from pagedserve.protocol import options as opts
from pagedserve.scheduler_proc.engine_config import EngineConfig
from pagedserve.worker_proc.__main__ import build_parser as worker_cli
from pagedserve.worker_proc.worker import WorkerConfig

# Values whose generic non-default (below) would break the option's own rule or another's.
SPECIAL = {"served_model_name": ["alias-a", "alias-b"], "chat_template": "{{ messages }}", "host": "127.0.0.2",
           "log_level": "DEBUG", "device": "cuda", "internal_host": None, "internal_port_base": None,
           "internal_curve": False, "remote_workers": False,
           # the two KV-cache budgets exclude each other; a generation config must exist
           "gpu_memory_utilization": 0.5, "generation_config": "vllm",
           "max_num_batched_tokens": 4096,  # at least the doubled max_num_seqs (512)
           # aging needs the priority policy; tenant weights need fair (their own test, below)
           "scheduling_policy": "priority", "tenant_weights": None,
           "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
           "pooler_config": '{"pooling_type": "MEAN"}'}  # vLLM's JSON, agreeing with --pooling-type mean
NEEDS_ANOTHER_POLICY = ("tenant_weights",)
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
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "torch_dtype": "float32"}))
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
        assert getattr(cfg, o.name) != o.default or o.name in ("dtype", unset, *NEEDS_ANOTHER_POLICY), \
            f"{o.flag} kept its default"

    engine = EngineConfig.from_args(scheduler_cli().parse_args(cfg.scheduler_cmd("run", replica=1)[3:]))
    expected = opts.values_of(cfg, opts.options_for(opts.SCHEDULER))
    expected.update(seed=cfg.seed + 1, record_trace=f"{cfg.record_trace}.1")  # per replica
    assert opts.values_of(engine, opts.options_for(opts.SCHEDULER)) == expected and engine.replica == 1

    ns = worker_cli().parse_args(cfg.worker_cmd("run", replica=1, rank=1, dist_init="tcp://127.0.0.1:1")[3:])
    worker = WorkerConfig(**{name: getattr(ns, name) for name in WorkerConfig.__dataclass_fields__})
    assert opts.values_of(worker, opts.options_for(opts.WORKER)) == opts.values_of(cfg, opts.options_for(opts.WORKER))
    assert (worker.replica, worker.rank, worker.dist_init) == (1, 1, "tcp://127.0.0.1:1")

    frontend = frontend_args(cfg.frontend_cmd("run")[3:])
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
        engine = EngineConfig.from_args(scheduler_cli().parse_args(cfg.scheduler_cmd("run", replica=0)[3:]))
        assert engine.tenant_weights == inline  # what a trace records: no file needed to replay
    with pytest.raises((ConfigError, ValueError), match="tenant-weights"):
        ServeConfig(model=model, scheduling_policy="fair", tenant_weights="gold=-1")
