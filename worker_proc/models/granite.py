"""Granite: Llama's layer with four multipliers: embeddings (``embedding_multiplier``), the attention
scale (``attention_multiplier``, in place of head_dim ** -0.5), each residual branch
(``residual_multiplier``) and the logits (divided by ``logits_scaling``)."""

from pagedserve.worker_proc.models.family import Family


def _granite(config) -> dict:
    return dict(embedding_scale=config.embedding_multiplier, attention_scale=config.attention_multiplier,
                residual_scale=config.residual_multiplier, logits_divisor=config.logits_scaling)


FAMILIES = {"GraniteForCausalLM": Family(read_config=_granite)}
