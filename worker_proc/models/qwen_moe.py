"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's layers with a mixture of experts as the MLP of every
``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (the others keep a dense MLP of
``intermediate_size``), routed by a softmax over the experts whose top k are renormalised only with
``norm_topk_prob`` and rounded to the model's dtype (models/moe.py). Qwen2-MoE adds a shared expert
of ``shared_expert_intermediate_size`` to every sparse layer, scaled by sigmoid(shared_expert_gate).
Checkpoint names: ``mlp.gate``, ``mlp.experts.N.{gate,up,down}_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``."""

from pagedserve.kernels.moe_routing import RoutingRule
from pagedserve.worker_proc.models.family import Family
from pagedserve.worker_proc.models.moe import MoeDecoderLayer, MoeSpec


def _experts(config) -> MoeSpec:
    num_experts, dense = config.num_experts, set(config.mlp_only_layers or ())
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
                   for i in range(config.num_hidden_layers))
    routing = RoutingRule(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    return MoeSpec(num_experts, config.moe_intermediate_size, shared, sparse, routing)


def _qwen2_moe(config) -> dict:
    # q/k/v biases by its qkv_bias (True in every released checkpoint), never o_proj's
    return dict(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, moe=_experts(config))


def _qwen3_moe(config) -> dict:
    return dict(qk_norm="head", moe=_experts(config))


FAMILIES = {"Qwen2MoeForCausalLM": Family(read_config=_qwen2_moe, layer=MoeDecoderLayer),
            "Qwen3MoeForCausalLM": Family(read_config=_qwen3_moe, layer=MoeDecoderLayer)}
