"""LoRA's options and adapters as serve and the offline LLM judge them before any process starts:
pure objects, adapter directories written in PEFT's format (support/lora_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.client.lora_adapters import AdapterNameError, AdapterRegistry, UnknownAdapter
from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.deploy.vllm_compat import unsupported_flag
from pagedserve.offline.engine_options import offline_config
from pagedserve.offline.lora import LoRARequest, as_lora_list, new_adapters
from pagedserve.protocol.block_hash import adapter_seed
from pagedserve.protocol.lora_adapter import LoRAAdapterError
from support.lora_files import write_adapter

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 256,
         "torch_dtype": "float32", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    (path / "config.json").write_text(json.dumps(LLAMA))
    return path


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory) -> str:
    return write_adapter(tmp_path_factory.mktemp("adapters") / "a", model, r=8, targets=("q_proj", "v_proj", "down_proj"))


def serve(model, **options) -> ServeConfig:
    return ServeConfig(model=str(model), **options)


# ------------------------------------------------------------------ serve's options


def test_vllms_lora_flags_that_are_served_pass_and_the_others_are_refused_naming_them():
    for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"):
        assert unsupported_flag([flag, "x"]) is None
    for flag in ("--fully-sharded-loras", "--lora-dtype", "--enable-lora-bias", "--lora-extra-vocab-size",
                 "--long-lora-scaling-factors"):
        complaint = unsupported_flag([f"{flag}=1"])
        assert complaint is not None and complaint.startswith(f"{flag} is a vLLM option")


def test_served_adapters_reach_the_frontend_with_their_paths_resolved(model, adapter, monkeypatch):
    monkeypatch.chdir(Path(adapter).parent)
    cfg = serve(model, enable_lora=True, max_loras=2, lora_modules=["sql=a", json.dumps({"name": "chat", "path": "a"})])
    assert cfg.lora_modules == [f"sql={adapter}", json.dumps({"name": "chat", "path": adapter})]
    frontend = cfg.frontend_cmd("run")
    assert "--enable-lora" in frontend and f"sql={adapter}" in frontend
    assert "--lora-modules" not in cfg.scheduler_cmd("run", 0)  # only the frontend registers them
    assert "--max-loras" in cfg.scheduler_cmd("run", 0) and "--max-lora-rank" in cfg.worker_cmd("run", 0, 0, None)


@pytest.mark.parametrize("given, complaint", [
    (dict(lora_modules=["a=/x"]), r"^--lora-modules: LoRA option\(s\) that need --enable-lora$"),
    (dict(max_loras=2, max_lora_rank=8), r"^--max-loras, --max-lora-rank: LoRA option\(s\) that need --enable-lora"),
    (dict(enable_lora=True, task="embed"), r"^--enable-lora: .*not by --task embed"),
    (dict(enable_lora=True, model_impl="transformers"), r"^--enable-lora: .*--model-impl transformers"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2),
     r"^--max-cpu-loras \(2\) must be at least --max-loras \(4\)"),
])
def test_lora_options_that_could_not_work_are_refused_in_one_line(model, given, complaint):
    with pytest.raises(ConfigError, match=complaint) as refused:
        serve(model, **given)
    assert "\n" not in str(refused.value)


def test_a_model_with_nothing_to_adapt_is_refused_with_enable_lora(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match=r"^--enable-lora: config.json has no adaptable projections"):
        serve(tmp_path, enable_lora=True)
    assert serve(tmp_path).enable_lora is False  # the base model alone is not this check's business


def test_an_architecture_only_the_transformers_backend_runs_is_refused_with_enable_lora(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["StableLmForCausalLM"],
                                                      "model_type": "stablelm"}))
    with pytest.raises(ConfigError, match="^--enable-lora: adapters run on the native model families only"):
        serve(tmp_path, enable_lora=True)


@pytest.mark.parametrize("config, complaint", [
    (dict(r=32), "rank 32 exceeds --max-lora-rank 16"),
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_a_bad_adapter_is_refused_naming_it_and_why(model, tmp_path, config, complaint):
    path = write_adapter(tmp_path / "bad", model, r=config.pop("r", 8), **config)
    with pytest.raises(ConfigError, match=f"^--lora-modules bad: LoRA adapter {path}: .*{complaint}"):
        serve(model, enable_lora=True, lora_modules=[f"bad={path}"])


def test_an_adapter_for_another_model_or_no_adapter_at_all_is_refused(model, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**LLAMA, "hidden_size": 48}))
    foreign = write_adapter(tmp_path / "foreign", other)
    with pytest.raises(ConfigError, match="does not fit the base model's 32 -> 32 projection"):
        serve(model, enable_lora=True, lora_modules=[f"f={foreign}"])
    with pytest.raises(ConfigError, match="^--lora-modules gone: LoRA adapter .*gone: does not exist"):
        serve(model, enable_lora=True, lora_modules=[f"gone={tmp_path / 'gone'}"])


def test_an_adapter_name_that_is_a_served_name_or_given_twice_is_refused(model, adapter):
    with pytest.raises(ConfigError, match="^--lora-modules base: .*'base' is the base model's served name"):
        serve(model, enable_lora=True, served_model_name=["base"], lora_modules=[f"base={adapter}"])
    with pytest.raises(ConfigError, match="^--lora-modules a: the name 'a' is given twice"):
        serve(model, enable_lora=True, lora_modules=[f"a={adapter}", f"a={adapter}"])
    with pytest.raises(ConfigError, match="base_model_name 'other' is not the served model"):
        serve(model, enable_lora=True, lora_modules=[json.dumps({"name": "a", "path": adapter,
                                                                 "base_model_name": "other"})])
    with pytest.raises(ConfigError, match="unknown key"):
        serve(model, enable_lora=True, lora_modules=[json.dumps({"name": "a", "path": adapter, "rank": 8})])


def test_the_offline_llm_takes_lora_modules_as_serve_does(model, adapter):
    cfg = offline_config(str(model), "WARNING", dict(enable_lora=True, lora_modules=[f"a={adapter}"]))
    assert cfg.lora_modules == [f"a={adapter}"]
    with pytest.raises(ConfigError, match="--lora-modules: LoRA option"):
        offline_config(str(model), "WARNING", dict(lora_modules=[f"a={adapter}"]))


# ------------------------------------------------------------------ the registry


def test_the_registry_numbers_adapters_from_one_and_never_reuses_an_id(model, adapter, tmp_path):
    registry = AdapterRegistry(model, 16, ["base"])
    first = registry.add("a", registry.read("a", adapter))
    second = registry.add("b", registry.read("b", adapter))
    assert (first.lora_id, second.lora_id) == (1, 2) and first.path == adapter
    with pytest.raises(AdapterNameError, match="^The lora adapter 'a' has already been loaded.$"):
        registry.check_free("a")
    registry.remove("a")
    assert registry.add("c", registry.read("c", adapter)).lora_id == 3
    with pytest.raises(UnknownAdapter, match="^The lora adapter 'a' cannot be found.$"):
        registry.remove("a")
    other = write_adapter(tmp_path / "other", model, seed=1)
    replaced = registry.add("b", registry.read("b", other), replace=True)
    assert replaced.lora_id == 2 and replaced.digest != second.digest
    assert registry.seed("b") == adapter_seed(replaced.digest) != 0 and registry.seed("") == 0
    with pytest.raises(AdapterNameError, match="base model's served name"):
        registry.read("base", adapter)


# ------------------------------------------------------------------ offline LoRARequest


def test_lora_request_is_vllms(adapter):
    request = LoRARequest("a", 1, adapter)
    assert (request.name, request.adapter_id, request.path) == ("a", 1, adapter)
    assert request == LoRARequest("a", 2, "/elsewhere") and len({request, LoRARequest("a", 3, "x")}) == 1
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("a", 0, adapter)
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("a", 1)


def test_lora_requests_are_one_per_prompt_and_need_enable_lora(adapter):
    request = LoRARequest("a", 1, adapter)
    assert as_lora_list(request, 3, True) == [request] * 3
    assert as_lora_list([request, None], 2, True) == [request, None]
    assert as_lora_list(None, 2, False) == [None, None]
    with pytest.raises(ValueError, match="Lengths of prompts and lora_request must be the same."):
        as_lora_list([request], 2, True)
    with pytest.raises(ValueError, match="but LoRA is not enabled!"):
        as_lora_list([None, request], 2, False)
    with pytest.raises(TypeError, match="LoRARequest or None"):
        as_lora_list(["a", None], 2, True)


def test_a_new_lora_request_is_read_and_registered_once_and_a_conflicting_one_is_refused(model, adapter, tmp_path):
    registry = AdapterRegistry(model, 16)
    request = LoRARequest("a", 7, adapter)
    [added] = new_adapters(registry, [request, None, request])
    assert (added.name, added.lora_id, added.path) == ("a", 7, adapter)
    assert new_adapters(registry, [request]) == []  # known: nothing to send again
    with pytest.raises(ValueError, match="was registered with lora_int_id 7"):
        new_adapters(registry, [LoRARequest("a", 8, adapter)])
    with pytest.raises(ValueError, match="was registered from"):
        new_adapters(registry, [LoRARequest("a", 7, write_adapter(tmp_path / "b", model, seed=2))])
    with pytest.raises(ValueError, match="lora_int_id 7 is already LoRA adapter 'a'"):
        new_adapters(registry, [LoRARequest("b", 7, adapter)])
    with pytest.raises(LoRAAdapterError, match="rank 32 exceeds --max-lora-rank 16"):
        new_adapters(registry, [LoRARequest("big", 9, write_adapter(tmp_path / "big", model, r=32))])
    assert [a.name for a in registry] == ["a"]  # nothing of a refused one was kept
