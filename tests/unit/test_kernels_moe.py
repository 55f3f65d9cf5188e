"""Mixture of experts: routing equals transformers' router modules, the torch reference equals
transformers' experts loop, and the CPU grouped path and the Triton fused_moe equal the reference.

The Triton kernel runs under TRITON_INTERPRET=1 on CPU (small shapes: the interpreter is slow), or
natively on a GPU (support/kernel_device.py); the CPU grouped path runs in every weight layout the
dense layers use (native panels, oneDNN packed, torch), float32 and bfloat16.
"""

from support.kernel_device import DEVICE, MARKS, to_device  # first: it decides TRITON_INTERPRET

import pytest
import torch

from pagedserve.kernels import fused_moe, moe_reference
from pagedserve.kernels.moe_routing import RoutingRule, route, sort_by_expert
from pagedserve.worker_proc.elementwise import TorchElementwise
from pagedserve.protocol.model_architectures import ModelConfigError, check_model_config
from pagedserve.worker_proc.models.family import family_of
from pagedserve.worker_proc.models import linear as linear_module
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout
from pagedserve.worker_proc.models.moe import grouped_experts

pytestmark = MARKS


def randn(*shape, dtype=torch.float32, seed=0, std=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)


def hf_config(family: str, **fields):
    import transformers

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)
    if family == "mixtral":
        return transformers.MixtralConfig(**{**common, **dict(num_local_experts=8, num_experts_per_tok=2,
                                                              intermediate_size=48), **fields})
    if family == "gpt_oss":
        return transformers.GptOssConfig(**{**common, **dict(num_local_experts=8, num_experts_per_tok=2,
                                                             intermediate_size=48, head_dim=16), **fields})
    cls = transformers.Qwen2MoeConfig if family == "qwen2_moe" else transformers.Qwen3MoeConfig
    return cls(**{**common, **dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48), **fields})


ROUTERS = {
    "mixtral": ("MixtralForCausalLM", "mixtral", "MixtralTopKRouter", {}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeTopKRouter", {}),
    "qwen2_moe_norm_topk_prob": ("Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeTopKRouter", dict(norm_topk_prob=True)),
    "qwen3_moe_norm_topk_prob": ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeTopKRouter", dict(norm_topk_prob=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeTopKRouter", dict(norm_topk_prob=False)),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss", "GptOssTopKRouter", {}),  # a bias; softmax over the top k
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(ROUTERS))
def test_routing_equals_the_router_module_of_each_family_in_transformers(case, dtype):
    import importlib

    arch, family, router_cls, fields = ROUTERS[case]
    config = hf_config(family, **fields)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    router = getattr(module, router_cls)(config).to(dtype)
    bias = getattr(router, "bias", None)
    with torch.no_grad():
        router.weight.copy_(randn(8, 64, seed=1, std=0.5))
        if bias is not None:
            bias.copy_(randn(8, seed=5))
    x = randn(37, 64, dtype=dtype, seed=2)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    moe = family_of(arch).read_config(config)["moe"]  # the family file's reading of its config
    assert moe.router_bias == (bias is not None)
    weights, ids = route(torch.nn.functional.linear(x, router.weight, bias), moe.routing)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype and torch.equal(weights, hf_weights)


def test_softmax_after_top_k_weighs_only_the_chosen_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    weights, ids = route(logits, RoutingRule(top_k=2, softmax_after_topk=True))
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))


@pytest.mark.parametrize("family, top_k", [("mixtral", 9), ("qwen3_moe", 0)])
def test_a_config_routing_to_more_experts_than_it_has_or_to_none_is_refused_in_one_line(tmp_path, family, top_k):
    arch = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    hf_config(family, num_experts_per_tok=top_k, architectures=[arch]).save_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match=rf"^config.json: num_experts_per_tok={top_k} needs between 1 and "
                                               rf"num_(local_)?experts=8 experts to pick from$"):
        check_model_config(tmp_path)


def test_sorting_by_expert_groups_each_experts_pairs_by_slot_then_token_as_transformers_loop_does():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2], [2, 0]])
    order = sort_by_expert(ids, num_experts=5)
    assert order.counts == [3, 0, 3, 2, 0]
    assert order.token_of.tolist() == [1, 0, 3, 3, 1, 2, 0, 2]
    assert order.pair.tolist() == [2, 1, 7, 6, 3, 5, 0, 4]


def experts_case(tokens: int, dtype: torch.dtype, num_experts: int = 8, top_k: int = 2, hidden: int = 64,
                 size: int = 48, seed: int = 0, unused: tuple[int, ...] = (5,)):
    """x, gate_up [E, 2I, H], down [E, H, I], and routing (weights, ids) that never picks ``unused``."""
    x = randn(tokens, hidden, dtype=dtype, seed=seed)
    gate_up = randn(num_experts, 2 * size, hidden, dtype=dtype, seed=seed + 1, std=0.2)
    down = randn(num_experts, hidden, size, dtype=dtype, seed=seed + 2, std=0.2)
    logits = randn(tokens, num_experts, seed=seed + 3)
    logits[:, list(unused)] = -1e4
    weights, ids = route(logits.to(dtype), RoutingRule(top_k, renormalize=True))
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_transformers_experts_loop_bit_for_bit(family, dtype):
    import importlib

    config = hf_config(family)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    experts = getattr(module, "MixtralExperts" if family == "mixtral" else "Qwen2MoeExperts")(config).to(dtype)
    experts.config._experts_implementation = "eager"
    x, gate_up, down, weights, ids = experts_case(29, dtype, top_k=config.num_experts_per_tok)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        expected = experts(x, ids, weights)
    assert torch.equal(moe_reference.fused_moe(x, gate_up, down, weights, ids), expected)


def gpt_oss_biases(num_experts: int = 8, hidden: int = 64, size: int = 48, dtype=torch.float32, seed: int = 7):
    """gpt-oss's expert biases, [E, 2I] and [E, H], and its activation with a limit random products reach."""
    return (randn(num_experts, 2 * size, dtype=dtype, seed=seed, std=0.5), randn(num_experts, hidden, dtype=dtype,
                                                                                 seed=seed + 1, std=0.5),
            moe_reference.ClampedSwiglu(alpha=1.702, limit=0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_with_biases_and_clamped_swiglu_is_gpt_oss_experts_loop(dtype):
    """transformers' GptOssExperts keeps gate_up as [E, H, 2I] with gate and up columns interleaved and
    down as [E, I, H]; the reference takes them as [gate; up] rows and [H, I] (the family's loader's layout)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = hf_config("gpt_oss", swiglu_limit=0.5)
    experts = GptOssExperts(config).to(dtype)
    experts.config = config
    config._experts_implementation = "eager"
    x, gate_up, down, weights, ids = experts_case(29, dtype)
    gate_up_bias, down_bias, activation = gpt_oss_biases(dtype=dtype)
    interleaved = torch.stack([gate_up[:, :48], gate_up[:, 48:]], dim=2).reshape(8, 96, 64)  # g0 u0 g1 u1 ...
    with torch.no_grad():
        experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack([gate_up_bias[:, :48], gate_up_bias[:, 48:]], dim=2).reshape(8, 96))
        experts.down_proj.copy_(down.transpose(1, 2))
        experts.down_proj_bias.copy_(down_bias)
        expected = experts(x, ids, weights)
    got = moe_reference.fused_moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    assert not torch.allclose(got.float(), moe_reference.fused_moe(x, gate_up, down, weights, ids, gate_up_bias,
                                                                   down_bias).float(), atol=1e-2)


# name -> (layout, PAGEDSERVE_CPU_NATIVE_LINEAR)
CPU_LAYOUTS = {
    "native_panels": (WeightLayout(plain=False, native=True), "1"),
    "onednn_packed": (WeightLayout(packed=True, plain=False), "0"),
    "torch_plain": (WeightLayout(), "0"),
    "in_out_copy_resident": (WeightLayout(transposed=True, resident=True), "0"),
}


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout_name", list(CPU_LAYOUTS))
def test_cpu_grouped_experts_equal_the_reference_in_every_weight_layout(layout_name, dtype, tokens):
    from pagedserve.kernels import cpu_native

    layout, _ = CPU_LAYOUTS[layout_name]
    if layout.native and not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here (it needs AVX2 and FMA, and a C compiler)")
    if layout.packed and not linear_module.packed_linear_available(dtype):
        pytest.skip(f"no oneDNN packed linear in {dtype} here")
    x, gate_up, down, weights, ids = experts_case(tokens, dtype, top_k=3)
    size = gate_up.shape[1] // 2
    experts = [(LinearWeight.of(gate_up[e].contiguous(), None, layout, gate_size=size),
                LinearWeight.of(down[e].contiguous(), None, layout)) for e in range(8)]
    got = grouped_experts(x, experts, weights, ids, TorchElementwise())
    expected = moe_reference.fused_moe(x, gate_up, down, weights, ids)
    assert got.dtype == dtype
    # The dense layers' paths sum in their own orders (W @ x.T, x @ W_t, panels, oneDNN) and in
    # bfloat16 round once where torch rounds twice: within float32 ulps, or a bfloat16 step.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    # gpt-oss's experts: biases on both products, the clamped SwiGLU on gate_up's (no silu_gate panels)
    gate_up_bias, down_bias, activation = gpt_oss_biases(dtype=dtype)
    experts = [(LinearWeight.of(gate_up[e].contiguous(), gate_up_bias[e], layout),
                LinearWeight.of(down[e].contiguous(), down_bias[e], layout)) for e in range(8)]
    got = grouped_experts(x, experts, weights, ids, TorchElementwise(), activation)
    expected = moe_reference.fused_moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


def test_an_expert_no_token_routes_to_is_never_multiplied():
    x, gate_up, down, weights, ids = experts_case(6, torch.float32, unused=(1, 5, 6))
    calls = []

    class Counting(LinearWeight):
        pass

    layout = WeightLayout()
    experts = []
    for e in range(8):
        gu = Counting.of(gate_up[e].contiguous(), None, layout, gate_size=48)
        experts.append((gu, LinearWeight.of(down[e].contiguous(), None, layout)))
    original = linear_module.linear

    def counting_linear(rows, w):
        calls.append(next(i for i, (gu, d) in enumerate(experts) if w is gu or w is d))
        return original(rows, w)

    import pagedserve.worker_proc.models.moe as moe_module

    saved = moe_module.linear, linear_module.linear
    moe_module.linear = linear_module.linear = counting_linear
    try:
        grouped_experts(x, experts, weights, ids, TorchElementwise())
    finally:
        moe_module.linear, linear_module.linear = saved
    assert not {1, 5, 6} & set(calls) and set(calls) == set(ids.unique().tolist())


# ---------------------------------------------------------------- Triton

def test_align_block_size_pads_each_experts_run_to_whole_blocks_and_names_their_experts():
    ids = to_device(torch.tensor([[3, 0], [0, 2], [3, 2], [3, 0]]))[0]
    sorted_ids, block_experts, used = fused_moe.moe_align_block_size(ids, num_experts=5, block_m=4)
    pad = ids.numel()
    assert used.item() == 12  # experts 0, 2 and 3: one block of 4 each
    assert block_experts.tolist()[:3] == [0, 2, 3] and set(block_experts.tolist()[3:]) == {-1}
    assert sorted_ids.tolist()[:12] == [1, 2, 7, pad, 3, 5, pad, pad, 0, 4, 6, pad]
    assert set(sorted_ids.tolist()[12:]) == {pad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3), (37, 2)])
def test_triton_fused_moe_equals_the_reference(dtype, tokens, top_k):
    x, gate_up, down, weights, ids = experts_case(tokens, dtype, top_k=top_k, hidden=48, size=40, seed=tokens)
    expected = moe_reference.fused_moe(x, gate_up, down, weights, ids)
    got = fused_moe.fused_moe(*to_device(x, gate_up, down, weights, ids))
    # float32: another summation order; half precision: the weight applied before one rounding
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float().cpu(), expected.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_triton_fused_moe_with_gpt_oss_biases_and_clamped_swiglu_equals_the_reference(dtype, tokens):
    x, gate_up, down, weights, ids = experts_case(tokens, dtype, hidden=48, size=40, seed=tokens)
    gate_up_bias, down_bias, activation = gpt_oss_biases(hidden=48, size=40, dtype=dtype)
    expected = moe_reference.fused_moe(x, gate_up, down, weights, ids, gate_up_bias, down_bias, activation)
    got = fused_moe.fused_moe(*to_device(x, gate_up, down, weights, ids, gate_up_bias, down_bias), activation)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float().cpu(), expected.float(), **tol)


def test_a_step_of_no_tokens_gives_no_rows_on_either_path():
    x, gate_up, down, weights, ids = experts_case(0, torch.float32)
    assert fused_moe.fused_moe(*to_device(x, gate_up, down, weights, ids)).shape == (0, 64)
    experts = [(LinearWeight.of(gate_up[e].contiguous(), None, WeightLayout(), gate_size=48),
                LinearWeight.of(down[e].contiguous(), None, WeightLayout())) for e in range(8)]
    assert grouped_experts(x, experts, weights, ids, TorchElementwise()).shape == (0, 64)
