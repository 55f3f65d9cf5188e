"""Gemma 2 and Gemma 3 (text): a norm before and after both attention and MLP, each scaling by
(1 + weight); embeddings times sqrt(hidden); a GeLU-tanh gated MLP; queries scaled by
``query_pre_attn_scalar``; alternating local (sliding window) and global layers (``layer_types``).
Gemma 2 soft-caps attention scores and logits (cap * tanh(x / cap)); Gemma 3 normalises each head of
q and k instead and gives its local layers their own rope base (``rope_local_base_freq``, kept by
transformers as ``rope_parameters["sliding_attention"]``)."""

from typing import Any

from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.models.family import Family, LayerNames

SANDWICH_NORMS = LayerNames(pre_attention_norm="input_layernorm", post_attention_norm="post_attention_layernorm",
                            pre_mlp_norm="pre_feedforward_layernorm", post_mlp_norm="post_feedforward_layernorm")


def _gemma(config: Any) -> dict:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention is not supported: the paged cache is causal")
    return dict(hidden_act=config.hidden_activation, norm_weight_offset=1.0,
                attention_scale=config.query_pre_attn_scalar**-0.5, embedding_scale=config.hidden_size**0.5,
                attn_logit_softcap=config.attn_logit_softcapping, final_logit_softcap=config.final_logit_softcapping)


def _gemma3(config: Any) -> dict:
    return dict(_gemma(config), qk_norm="head", layer_rope_types=tuple(config.layer_types))


FAMILIES = {"Gemma2ForCausalLM": Family(SANDWICH_NORMS, _gemma), "Gemma3ForCausalLM": Family(SANDWICH_NORMS, _gemma3)}
