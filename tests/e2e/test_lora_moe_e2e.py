"""LoRA adapters on mixtures of experts through the real server: a deployment mixing two adapters
(one on the routed experts alone, PEFT's ``target_parameters`` on ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj``; one on attention, the experts' down and, in Qwen2-MoE, its shared expert,
with rsLoRA) and the base model in its steps answers, request by request, what
``PeftModel.from_pretrained(...).generate(do_sample=False)`` answers in float32: Qwen3-MoE at TP=1
and TP=2 (each rank half of every expert's intermediate features and of its adapters'), Qwen2-MoE's
shared expert and gpt-oss's interleaved gate_up columns split across two ranks, Mixtral."""

from __future__ import annotations

import pytest
from pagedserve.tools.lora_adapters import make_adapter
from support.server import Server
from test_lora_e2e import _check_mix

pytestmark = pytest.mark.slow

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MODELS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, seed=5),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, seed=6),
    "gpt_oss": dict(intermediate_size=48, swiglu_limit=1.5, seed=4),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, seed=7),
}
SHARED_EXPERT = ("gate_proj", "up_proj", "down_proj")


def _adapted(model_factory, root, arch: str) -> tuple[str, dict[str, str]]:
    model = model_factory(arch, **MODELS[arch])
    mixed_targets = ("q_proj", "v_proj") + (SHARED_EXPERT if arch == "qwen2_moe" else ())
    return model, {"experts": make_adapter(model, str(root / "experts"), r=8, alpha=16, targets=(), seed=41,
                                           parameters=EXPERTS),
                   "mixed": make_adapter(model, str(root / "mixed"), r=4, alpha=8, targets=mixed_targets,
                                         seed=42, rslora=True, parameters=EXPERTS[1:])}


@pytest.mark.parametrize("arch, tp", [("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen2_moe", 2), ("gpt_oss", 2),
                                      ("mixtral", 1)])
def test_two_expert_adapters_and_the_base_model_in_one_batch_equal_peft_greedy(arch, tp, model_factory,
                                                                               tmp_path_factory, tmp_path):
    model, adapters = _adapted(model_factory, tmp_path_factory.mktemp(f"adapters-{arch}"), arch)
    srv = Server(model, ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
                         *(f"{name}={path}" for name, path in adapters.items()), "--enable-prefix-caching",
                         "--block-size", "4", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                         "--max-model-len", "128", "--dtype", "float32", "-tp", str(tp)]).start(tmp_path)
    try:
        _check_mix(srv, model, adapters, [None, "experts", "mixed"])
    finally:
        srv.stop()
