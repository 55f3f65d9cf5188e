"""Qwen2 (q/k/v biases always, never o_proj's) and Qwen3 (RMSNorm of each head of q and k)."""

from pagedserve.worker_proc.models.family import Family


def _qwen2(config) -> dict:
    return dict(qkv_bias=True, o_bias=False)


def _qwen3(config) -> dict:
    return dict(qk_norm="head")


FAMILIES = {"Qwen2ForCausalLM": Family(read_config=_qwen2), "Qwen3ForCausalLM": Family(read_config=_qwen3)}
