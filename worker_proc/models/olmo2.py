"""OLMo 2: norms after attention and after the MLP (none before), and RMSNorm over the whole q and k
projections (not per head). That norm spans every head, so a layer cannot be cut by heads across
tensor-parallel ranks without an all-reduce inside it: refused there."""

from pagedserve.worker_proc.models.family import Family, LayerNames

POST_NORMS = LayerNames(pre_attention_norm=None, post_attention_norm="post_attention_layernorm",
                        pre_mlp_norm=None, post_mlp_norm="post_feedforward_layernorm")


def _olmo2(config) -> dict:
    return dict(qk_norm="projection")


FAMILIES = {"Olmo2ForCausalLM": Family(POST_NORMS, _olmo2, tensor_parallel=False)}
