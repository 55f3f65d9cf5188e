"""The registry of model families: every architecture the launcher accepts is one the worker runs,
and a model the workers would refuse is refused from its config.json alone, in one line."""

from __future__ import annotations

import json

import pytest
from pagedserve.deploy.serve_config import ConfigError, ServeConfig
from pagedserve.protocol.model_architectures import (
    ARCHITECTURES,
    ModelConfigError,
    check_model_config,
)
from pagedserve.worker_proc.model_config import UnsupportedModelError, load_model_spec
from pagedserve.worker_proc.models.family import Family, family_of
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard


def rewrite_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return model_dir


@pytest.fixture
def model_copy(model_factory, tmp_path):
    """A fresh copy of a built model whose config.json a test may change."""
    import shutil

    def copy(arch: str, **overrides):
        target = tmp_path / arch
        shutil.copytree(model_factory(arch, **overrides), target)
        return target

    return copy


def test_every_registered_architecture_names_a_family_file_that_declares_it():
    for arch in ARCHITECTURES:
        assert isinstance(family_of(arch), Family), arch


def test_an_unsupported_architecture_is_refused_in_one_line_naming_every_supported_one(model_copy):
    """Natively (the workers' check, and serve's with --model-impl native). With auto, GPT-2 goes to
    the transformers backend; a name transformers does not know either is refused by serve as well."""
    model = rewrite_config(model_copy("qwen2"), architectures=["GPT2LMHeadModel"], model_type="gpt2")
    for refuse in (check_model_config, load_model_spec, lambda m: ServeConfig(model=str(m), model_impl="native")):
        with pytest.raises((ModelConfigError, ConfigError)) as caught:
            refuse(model)
        message = str(caught.value)
        assert "\n" not in message and "GPT2LMHeadModel" in message and "is not supported" in message
        assert all(arch in message for arch in ARCHITECTURES)
    assert ServeConfig(model=str(model)).model_impl == "auto"  # the backend probes it at start
    unknown = rewrite_config(model, architectures=["NoSuchModelForCausalLM"])
    with pytest.raises(ConfigError, match="NoSuchModelForCausalLM.*no causal LM of transformers"):
        ServeConfig(model=str(unknown))


@pytest.mark.parametrize("changes, named", [
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=None), "sliding_window"),
])
def test_a_config_that_contradicts_itself_is_refused_before_serving(model_copy, changes, named):
    model = rewrite_config(model_copy("gemma2"), **changes)
    with pytest.raises(ConfigError) as caught:
        ServeConfig(model=str(model))
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_a_window_longer_than_the_models_positions_is_served_as_real_phi3_checkpoints_ship_it(model_copy):
    """Phi-3.5-mini: a window of 262144 over 131072 positions never binds; it is not a broken config."""
    model = rewrite_config(model_copy("phi3"), sliding_window=262144, max_position_embeddings=131072)
    assert check_model_config(model) == "Phi3ForCausalLM"
    assert load_model_spec(model).layer_sliding_windows == (262144, 262144)


def test_olmo2_is_refused_across_tensor_parallel_ranks_its_qk_norm_spans_every_head(model_factory):
    spec = load_model_spec(model_factory("olmo2"))
    assert spec.qk_norm == "projection"
    with pytest.raises(UnsupportedModelError, match="tensor-parallel-size must be 1"):
        TensorParallelShard.for_rank(spec, 0, 2)


def test_a_longrope_model_is_served_up_to_its_original_length_and_a_longer_one_refused(tmp_path):
    """Past original_max_position_embeddings transformers recomputes the whole sequence with the long
    factors: the default length stops there, a longer one asked for is refused in one line."""
    from pagedserve.protocol.messages import WorkerInit
    from pagedserve.tools.demo_model import build_model_dir
    from pagedserve.worker_proc.model_runner import ModelRunner

    model = str(build_model_dir(tmp_path / "phi3", "phi3", original_max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.5] * 8, "long_factor": [6.0] * 8}))
    assert ServeConfig(model=model).max_model_len == 256
    with pytest.raises(ConfigError) as caught:
        ServeConfig(model=model, max_model_len=1024)
    assert "longrope" in str(caught.value) and "--max-model-len 256" in str(caught.value)
    assert "\n" not in str(caught.value)
    runner = ModelRunner(model)
    with pytest.raises(UnsupportedModelError, match="longrope"):
        runner.init_cache(WorkerInit(num_gpu_blocks=8, num_cpu_blocks=0, block_size=16, max_model_len=1024, seed=0))
