"""The adapter reader every process shares (protocol/lora_adapter.py): what peft writes is read as
peft means it (rank, scaling with and without rsLoRA, targets), and each adapter that cannot be
served is refused with a message naming the reason, before any tensor is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pagedserve.protocol.block_hash import adapter_seed, prefix_block_hashes
from pagedserve.protocol.lora_adapter import LoRAAdapterError, projection_shapes, read_adapter
from pagedserve.tools.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama", num_layers=2)


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    return make_adapter(model, str(tmp_path_factory.mktemp("lora") / "a"), r=8, alpha=16,
                        targets=["q_proj", "v_proj", "down_proj"], seed=1)


def _shapes(model: str) -> dict:
    return projection_shapes(json.loads((Path(model) / "config.json").read_text()))


def _copy(adapter: str, tmp_path: Path, **config) -> str:
    out = tmp_path / "copy"
    shutil.copytree(adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(config)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return str(out)


def test_peft_adapter_is_read_as_peft_means_it(model, adapter, tmp_path):
    spec = read_adapter(adapter, 16, _shapes(model), 2)
    assert (spec.rank, spec.scaling, spec.target_modules, spec.num_layers) == (8, 2.0, ("down_proj", "q_proj", "v_proj"), 2)
    assert spec.tensors[(0, "q_proj", "A")][1] == (8, 64) and spec.tensors[(1, "down_proj", "B")][1] == (64, 8)
    rs = read_adapter(_copy(adapter, tmp_path, use_rslora=True), 16)
    assert rs.scaling == pytest.approx(16 / 8 ** 0.5)
    assert rs.digest != spec.digest  # the config's bytes are part of what a replay must load again


@pytest.mark.parametrize("change, reason", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"bias": "all"}, "biases"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"r": 4}, "the config says r=4"),
])
def test_unservable_configs_are_refused_by_name(adapter, tmp_path, change, reason):
    with pytest.raises(LoRAAdapterError, match=reason):
        read_adapter(_copy(adapter, tmp_path, **change), 16)


def test_rank_above_the_limit_missing_and_corrupt_files_are_refused(model, adapter, tmp_path):
    with pytest.raises(LoRAAdapterError, match="rank 8 exceeds --max-lora-rank 4"):
        read_adapter(adapter, 4)
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        read_adapter(str(tmp_path / "nowhere"), 16)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        read_adapter(str(tmp_path), 16)
    broken = Path(_copy(adapter, tmp_path))
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(LoRAAdapterError, match="truncated or corrupt"):
        read_adapter(str(broken), 16)
    weights.write_bytes(b"\xff" * 12)
    with pytest.raises(LoRAAdapterError, match="corrupt"):
        read_adapter(str(broken), 16)


def test_an_adapter_of_another_model_is_refused(adapter, model_factory):
    wider = model_factory("llama", num_layers=2, hidden_size=128)
    with pytest.raises(LoRAAdapterError, match="does not fit the base model"):
        read_adapter(adapter, 16, _shapes(wider), 2)
    with pytest.raises(LoRAAdapterError, match="layer 1 does not exist"):
        read_adapter(adapter, 16, None, 1)


def test_prefix_block_names_differ_by_adapter_and_not_for_the_base_model():
    tokens = list(range(40))
    base = prefix_block_hashes(tokens, 4)
    assert prefix_block_hashes(tokens, 4, adapter_seed("")) == base
    a, b = (prefix_block_hashes(tokens, 4, adapter_seed(d)) for d in ("ab" * 32, "cd" * 32))
    assert len({*base, *a, *b}) == 3 * len(base)
