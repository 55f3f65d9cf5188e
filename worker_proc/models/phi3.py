"""Phi-3 (and Phi-4-mini, the same architecture): Llama's layer with q/k/v fused in one ``qkv_proj``
and gate/up in one ``gate_up_proj`` in the checkpoint (sliced per tensor-parallel rank at load),
longrope scaling and a partial rotary factor (rotary.py)."""

from pagedserve.worker_proc.models.family import Family, LayerNames

FAMILIES = {"Phi3ForCausalLM": Family(LayerNames(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)))}
