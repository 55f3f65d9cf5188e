"""The client side of embeddings: the pooler from vLLM's flags, Matryoshka ``dimensions`` only where
the model declares them, and truncation before normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.client.pooling import Matryoshka, PoolerSettings, finish_embedding, pooler_settings


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

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "torch_dtype": "float32"}))
    cfg = ServeConfig(model=str(tmp_path), task="pooling", pooler_config='{"pooling_type": "MEAN"}')
    frontend = parse_args(cfg.frontend_cmd("run")[3:])
    assert (frontend.task, frontend.pooler) == ("embed", PoolerSettings("mean", True))
    assert parse_args(["--run-dir", "r", "--model", str(tmp_path), "--runner", "pooling"]).task == "embed"
    with pytest.raises(ConfigError, match="are for --task embed"):
        ServeConfig(model=str(tmp_path), pooling_type="mean")
    with pytest.raises(ConfigError, match="disagree"):
        ServeConfig(model=str(tmp_path), task="embed", pooling_type="last", pooler_config='{"pooling_type": "MEAN"}')
