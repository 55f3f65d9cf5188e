"""LoRA adapters for tests (no tests here): PEFT's own adapters on a small model dir, the
LoRAAdapter message naming one, and transformers + peft's greedy tokens through one (the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from pagedserve.protocol.lora_adapter import read_adapter
from pagedserve.protocol.messages import LoRAAdapter

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: str | Path, out_dir: str | Path, r: int = 8, alpha: float = 16,
                 targets: Iterable[str] = ALL_TARGETS, seed: int = 0, rslora: bool = False) -> str:
    """A random PEFT LoRA adapter of the float32 model in ``model_dir``, saved (safetensors) in ``out_dir``.
    ``init_lora_weights=False``: B is random too, so each adapter changes the model's tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=rslora)
    get_peft_model(model, config).save_pretrained(str(out_dir))
    return str(out_dir)


def adapter_message(name: str, path: str, lora_id: int = 1, max_rank: int = 64) -> LoRAAdapter:
    """The LoRAAdapter a frontend sends for the adapter at ``path`` (its digest as read now)."""
    spec = read_adapter(path, max_rank)
    return LoRAAdapter(name=name, lora_id=lora_id, path=spec.path, digest=spec.digest)


def peft_greedy(model_dir: str | Path, adapter_dir: str | Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """transformers + peft's greedy tokens (float32, one prompt at a time) through the adapter
    (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_new_tokens)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs
