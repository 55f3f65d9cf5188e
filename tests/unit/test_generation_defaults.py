"""--generation-config and --gpu-memory-utilization: what they change (pure objects)."""

from __future__ import annotations

import json

import psutil
import pytest
import torch

from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, CompletionRequest
from pagedserve.frontend_proc.serving import Serving
from pagedserve.client.generation_defaults import (
    GenerationConfigError, GenerationDefaults, load_generation_defaults)
from pagedserve.worker_proc.kv_cache import max_num_blocks


@pytest.fixture
def model_dir(tmp_path):
    def make(generation_config=None):
        path = tmp_path / "model"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                      "max_position_embeddings": 128}))
        if generation_config is not None:
            (path / "generation_config.json").write_text(json.dumps(generation_config))
        return str(path)
    return make


QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
             "repetition_penalty": 1.05, "eos_token_id": [1, 2], "max_new_tokens": 40}


def test_auto_reads_the_model_dirs_sampling_fields_as_vllm_does(model_dir):
    defaults = load_generation_defaults("auto", model_dir(QWEN_LIKE))
    assert defaults.as_dict() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                  "repetition_penalty": 1.05, "max_tokens": 40}
    assert load_generation_defaults("vllm", model_dir(QWEN_LIKE)) == GenerationDefaults()


def test_values_equal_to_transformers_defaults_set_nothing_and_a_directory_is_read(model_dir, tmp_path):
    assert load_generation_defaults("auto", model_dir({"temperature": 1.0, "top_k": 50})).as_dict() == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.1}))
    assert load_generation_defaults(str(other), model_dir()).as_dict() == {"min_p": 0.1}


@pytest.mark.parametrize("bad", [{"temperature": "hot"}, {"temperature": -1.0}, {"top_p": 0}])
def test_an_unusable_generation_config_is_refused_at_start(model_dir, bad):
    with pytest.raises(GenerationConfigError):
        load_generation_defaults("auto", model_dir(bad))
    with pytest.raises(ConfigError):
        ServeConfig(model=model_dir(bad))
    with pytest.raises(ConfigError, match="generation-config"):
        ServeConfig(model=model_dir(), generation_config="/no/such/dir")


def _serving(defaults: GenerationDefaults) -> Serving:
    return Serving(["m"], 128, engine=None, tokenizer=None, metrics=None, defaults=defaults)


def test_defaults_apply_to_fields_a_request_omits_and_the_request_wins(model_dir):
    serving = _serving(load_generation_defaults("auto", model_dir(QWEN_LIKE)))
    omitted = serving._sampling(CompletionRequest(prompt="x"), 5, False)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    given = serving._sampling(CompletionRequest(prompt="x", temperature=0.0, top_k=-1, top_p=1.0), 5, False)
    assert (given.temperature, given.top_k, given.top_p, given.repetition_penalty) == (0.0, 0, 1.0, 1.05)
    plain = _serving(GenerationDefaults())._sampling(CompletionRequest(prompt="x"), 5, False)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_max_new_tokens_bounds_an_omitted_max_tokens_only(model_dir):
    serving = _serving(load_generation_defaults("auto", model_dir(QWEN_LIKE)))
    assert serving._max_tokens(10, None, default=None) == 40  # chat: the room left, bounded
    assert serving._max_tokens(10, None, default=16) == 16  # completions' own default is smaller
    assert serving._max_tokens(100, None, default=None) == 28  # the room left is smaller still
    assert serving._max_tokens(10, 100, default=None) == 100
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).requested_max_tokens() is None


def test_gpu_memory_utilization_sizes_the_kv_cache_and_cannot_be_ignored(model_dir):
    cfg = ServeConfig(model=model_dir(), gpu_memory_utilization=0.5, tensor_parallel_size=2)
    cmd = cfg.worker_cmd("/tmp/run", 0, 0, None)
    assert float(cmd[cmd.index("--gpu-memory-utilization") + 1]) == 0.25  # two CPU workers share RAM
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="gpu-memory-utilization"):
            ServeConfig(model=model_dir(), gpu_memory_utilization=bad)
    with pytest.raises(ConfigError, match="give one"):
        ServeConfig(model=model_dir(), gpu_memory_utilization=0.5, kv_cache_memory_gib=1.0)
    block = 1 << 20
    blocks = max_num_blocks(block, torch.device("cpu"), None, 0, memory_utilization=0.01)
    assert blocks == int(psutil.virtual_memory().total * 0.01) // block
    assert max_num_blocks(block, torch.device("cpu"), None, 0) == 1024  # 1 GiB without it


def test_on_cuda_the_share_of_the_whole_device_less_what_is_in_use_goes_to_the_kv_cache(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))  # 20 GiB in use
    cuda = torch.device("cuda", 0)
    headroom = gib
    # 0.5 x 80 = 40 GiB for the deployment: 20 in use, 1 of headroom, 19 for the cache
    assert max_num_blocks(gib, cuda, None, headroom, memory_utilization=0.5) == 19
    assert max_num_blocks(gib, cuda, None, headroom, memory_utilization=0.2) == 0  # already over its share
    assert max_num_blocks(gib, cuda, None, headroom) == int(60 * 0.9) - 1  # without it: 90% of free
