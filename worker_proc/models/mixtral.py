"""Mixtral: Mistral's layer with a mixture of experts in every layer's MLP (models/moe.py): softmax
over the experts, the top k renormalised (a softmax over the top-k logits), their weights kept in
float32; experts as ``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from pagedserve.kernels.moe_routing import RoutingRule
from pagedserve.worker_proc.models.family import Family
from pagedserve.worker_proc.models.moe import ExpertNames, MoeDecoderLayer, MoeSpec


def _mixtral(config) -> dict:
    routing = RoutingRule(config.num_experts_per_tok, renormalize=True, weights_in_float32=True)
    return dict(moe=MoeSpec(config.num_local_experts, config.intermediate_size, 0,
                            (True,) * config.num_hidden_layers, routing,
                            ExpertNames("block_sparse_moe.", ("w1", "w3", "w2"))))


FAMILIES = {"MixtralForCausalLM": Family(read_config=_mixtral, layer=MoeDecoderLayer)}
