"""LoRA adapters for tests (no tests here): PEFT's own adapters on a small model dir (tools/lora_adapters.py), the
LoRAAdapter message naming one, and transformers + peft's greedy tokens through one (the oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.protocol.lora_adapter import read_adapter
from pagedserve.protocol.messages import LoRAAdapter
from pagedserve.tools.lora_adapters import ALL_PROJECTIONS, make_adapter  # noqa: F401  (re-exported)

ALL_TARGETS = ALL_PROJECTIONS


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
