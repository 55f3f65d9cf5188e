"""Phi-3: Llama's layer with q/k/v fused in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` in
the checkpoint (sliced per tensor-parallel rank at load), and longrope scaling (rotary.py); a
partial rotary factor is refused there."""

from pagedserve.worker_proc.models.family import Family, LayerNames

FAMILIES = {"Phi3ForCausalLM": Family(LayerNames(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)))}
