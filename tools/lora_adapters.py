"""Random LoRA adapters in PEFT's own format, made by peft itself: for tests and benches, where
no real fine-tune can be downloaded. ``init_lora_weights=False`` draws B as well as A, so every
adapter changes the model's outputs (PEFT's default B = 0 would make it the base model)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_dir: str, out_dirs: Sequence[str], r: int = 8, alpha: float = 16,
                  targets: Sequence[str] = ALL_PROJECTIONS, seeds: Sequence[int] = (), rslora: bool = False,
                  scale: float = 1.0, parameters: Sequence[str] = ()) -> list[str]:
    """Write one adapter per ``out_dirs`` entry for the model at ``model_dir`` (loaded once);
    returns the directories. ``scale`` multiplies B, so a bench's adapters can be as small as a
    trained one's are relative to the base weights. ``parameters``: PEFT's ``target_parameters``
    (a mixture of experts' ``EXPERT_PARAMETERS``), beside the modules ``targets``."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets) or None, init_lora_weights=False,
                        use_rslora=rslora, target_parameters=list(parameters) or None)
    model = get_peft_model(base, config)
    written = []
    for i, out in enumerate(out_dirs):
        gen = torch.Generator().manual_seed(seeds[i] if i < len(seeds) else 1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    bound = 1.0 / max(1, param.shape[1]) ** 0.5  # kaiming-uniform's scale, as peft draws A
                    values = (torch.rand(param.shape, generator=gen) * 2 - 1) * bound
                    param.copy_(values * (scale if "lora_B" in name else 1.0))
        Path(out).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        written.append(str(out))
    return written


def make_adapter(model_dir: str, out_dir: str, r: int = 8, alpha: float = 16,
                 targets: Sequence[str] = ALL_PROJECTIONS, seed: int = 0, rslora: bool = False,
                 parameters: Sequence[str] = ()) -> str:
    return make_adapters(model_dir, [out_dir], r, alpha, targets, [seed], rslora, parameters=parameters)[0]
