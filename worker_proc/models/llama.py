"""Llama and Mistral: the pre-norm decoder every other family is told apart from (RMSNorm, rotary,
grouped-query attention, SiLU-gated MLP; Mistral's window on every layer comes from its config)."""

from pagedserve.worker_proc.models.family import Family

FAMILIES = {"LlamaForCausalLM": Family(), "MistralForCausalLM": Family()}
