"""LoRA adapter directories in PEFT's on-disk format, written without a model: the config PEFT
saves and ``lora_A`` / ``lora_B`` tensors under PEFT's names, shaped for a base model's config.json.

For tests of what reads an adapter (serve's checks, the frontend's registry, the offline LLM's
validation): no forward pass reads these weights. Tests that compare generations make their
adapters with peft itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
from safetensors.numpy import save_file

from pagedserve.protocol.lora_adapter import ATTENTION_MODULES, projection_shapes


def write_adapter(out_dir: str | Path, model_dir: str | Path, r: int = 8, alpha: float = 16,
                  targets: Sequence[str] = ("q_proj", "v_proj"), seed: int = 0, **config) -> str:
    """An adapter of rank ``r`` on ``targets`` of every layer of the model in ``model_dir``;
    ``config``: adapter_config.json keys to add or override (``use_dora=True``, ...)."""
    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = projection_shapes(model_cfg)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(int(model_cfg["num_hidden_layers"])):
        for module in targets:
            d_in, d_out = shapes[module]
            part = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.1, (r, d_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.1, (d_out, r)).astype(np.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False, "layers_to_transform": None,
        "base_model_name_or_path": str(model_dir), **config}))
    return str(out)
