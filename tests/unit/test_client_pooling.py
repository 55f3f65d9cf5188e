"""The client side of embeddings: the pooler from vLLM's flags, Matryoshka ``dimensions`` only where
the model declares them, and truncation before normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.client.pooling import Matryoshka, PoolerSettings, finish_embedding, pooler_settings
from pagedserve.deploy.entry_points import arguments_of


def test_the_pooler_comes_from_pooling_type_or_vllms_pooler_config():
    assert pooler_settings(None, None) == PoolerSettings("last", True)
    assert pooler_settings("mean", None) == PoolerSettings("mean", True)
    assert pooler_settings(None, '{"pooling_type": "MEAN", "normalize": false}') == PoolerSettings("mean", False)
    assert pooler_settings("last", '{"pooling_type": "LAST"}') == PoolerSettings("last", True)


@pytest.mark.parametrize("pooling_type, config, match", [
    ("last", '{"pooling_type": "MEAN"}', "disagree"),
    (None, '{"pooling_type": "CLS"}', "LAST, MEAN"),
    (None, '{"softmax": true}', "softmax not supported"),
    (None, "MEAN", "not JSON"),
    (None, '{"normalize": "yes"}', "true or false"),
])
def test_a_pooler_config_that_cannot_work_is_refused_naming_why(pooling_type, config, match):
    with pytest.raises(ValueError, match=match):
        pooler_settings(pooling_type, config)


def test_dimensions_need_a_model_that_declares_matryoshka_training():
    assert "does not declare" in Matryoshka.of({}).refusal(16, 64)
    assert Matryoshka.of({"is_matryoshka": True}).refusal(16, 64) is None
    assert "between 1 and the model's 64" in Matryoshka.of({"is_matryoshka": True}).refusal(65, 64)
    sized = Matryoshka.of({"matryoshka_dimensions": [16, 32]})
    assert sized.refusal(32, 64) is None and "one of [16, 32]" in sized.refusal(24, 64)


def test_an_embedding_is_truncated_first_then_normalised():
    raw = np.array([3.0, 4.0, 12.0], "<f4").tobytes()
    np.testing.assert_allclose(finish_embedding(raw), np.array([3, 4, 12]) / 13, rtol=1e-6)
    np.testing.assert_allclose(finish_embedding(raw, 2), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(finish_embedding(raw, None, normalize=False), [3, 4, 12])
    assert finish_embedding(np.zeros(3, "<f4").tobytes()).tolist() == [0.0, 0.0, 0.0]


def test_vllms_spellings_of_the_task_and_the_pooler_reach_the_frontend(tmp_path):
    import json

    from pagedserve.deploy.serve_config import ConfigError, ServeConfig
    from pagedserve.frontend_proc.args import parse_args

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                      "max_position_embeddings": 512, "torch_dtype": "float32"}))
    cfg = ServeConfig(model=str(tmp_path), task="pooling", pooler_config='{"pooling_type": "MEAN"}')
    frontend = parse_args(arguments_of(cfg.frontend_cmd("run")))
    assert (frontend.task, frontend.pooler) == ("embed", PoolerSettings("mean", True))
    assert parse_args(["--run-dir", "r", "--model", str(tmp_path), "--runner", "pooling"]).task == "embed"
    with pytest.raises(ConfigError, match="are for --task embed"):
        ServeConfig(model=str(tmp_path), pooling_type="mean")
    with pytest.raises(ConfigError, match="disagree"):
        ServeConfig(model=str(tmp_path), task="embed", pooling_type="last", pooler_config='{"pooling_type": "MEAN"}')


def _sentence_transformers_dir(path, mode: str, normalize: bool) -> str:
    import json

    from pagedserve.tools.demo_model import build_model_dir

    model_dir = build_model_dir(path, "qwen2")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (model_dir / "2_Normalize").mkdir()
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    modes = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return str(model_dir)


@pytest.mark.parametrize("mode, normalize, expected", [
    ("mean_tokens", True, PoolerSettings("mean", True)),
    ("mean_tokens", False, PoolerSettings("mean", False)),  # no Normalize module: raw pooled vectors
    ("lasttoken", True, PoolerSettings("last", True)),
])
def test_a_sentence_transformers_model_brings_its_pooler_as_the_embed_default(tmp_path, mode, normalize, expected):
    from pagedserve.frontend_proc.embeddings_api import EmbeddingServing

    model_dir = _sentence_transformers_dir(tmp_path, mode, normalize)
    serving = EmbeddingServing("embed", model_dir, ["m"], ["m"], 256, None, None, pooler_settings(None, None))
    assert serving.pooler == expected
    assert EmbeddingServing("generate", model_dir, ["m"], ["m"], 256, None, None,
                            pooler_settings(None, None)).pooler == PoolerSettings("last", True)


def test_the_flags_win_over_the_models_pooler_field_by_field(tmp_path):
    model_dir = _sentence_transformers_dir(tmp_path, "mean_tokens", False)
    assert pooler_settings("last", None).under_model_defaults(model_dir) == PoolerSettings("last", False)
    assert (pooler_settings(None, '{"normalize": true}').under_model_defaults(model_dir)
            == PoolerSettings("mean", True))
    assert pooler_settings(None, None).under_model_defaults(tmp_path / "none") == PoolerSettings("last", True)


@pytest.mark.parametrize("mode", ["cls_token", "max_tokens"])
def test_a_pooling_mode_this_server_cannot_pool_is_refused_unless_a_flag_overrides_it(tmp_path, mode):
    model_dir = _sentence_transformers_dir(tmp_path, mode, True)
    with pytest.raises(ValueError, match=f"pooling mode {mode.removesuffix('_tokens').removesuffix('_token')}"):
        pooler_settings(None, None).under_model_defaults(model_dir)
    assert pooler_settings("mean", None).under_model_defaults(model_dir) == PoolerSettings("mean", True)
