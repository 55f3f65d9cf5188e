"""LoRA adapters on a mixture of experts' routed experts through the real server: a Qwen3-MoE
deployment mixing two expert adapters (PEFT's ``target_parameters`` on ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj``, one with attention projections and rsLoRA too) and the base model in
its steps answers, request by request, what ``PeftModel.from_pretrained(...).generate(do_sample=False)``
answers in float32, at TP=1 and with two tensor-parallel ranks, each holding half of every expert's
intermediate features and of its adapters'."""

from __future__ import annotations

import pytest
from pagedserve.tools.lora_adapters import make_adapter
from support.server import Server
from test_lora_e2e import _check_mix

pytestmark = pytest.mark.slow

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def expert_adapters(model_factory, tmp_path_factory):
    model = model_factory("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, seed=5)
    root = tmp_path_factory.mktemp("expert-adapters")
    adapters = {"experts": make_adapter(model, str(root / "experts"), r=8, alpha=16, targets=(), seed=41,
                                        parameters=EXPERTS),
                "mixed": make_adapter(model, str(root / "mixed"), r=4, alpha=8, targets=("q_proj", "v_proj"),
                                      seed=42, rslora=True, parameters=EXPERTS[1:])}
    return model, adapters


@pytest.mark.parametrize("tp", [1, 2])
def test_two_expert_adapters_and_the_base_model_in_one_batch_equal_peft_greedy(tp, expert_adapters, tmp_path):
    model, adapters = expert_adapters
    srv = Server(model, ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
                         *(f"{name}={path}" for name, path in adapters.items()), "--enable-prefix-caching",
                         "--block-size", "4", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                         "--max-model-len", "128", "--dtype", "float32", "-tp", str(tp)]).start(tmp_path)
    try:
        _check_mix(srv, model, adapters, [None, "experts", "mixed"])
    finally:
        srv.stop()
