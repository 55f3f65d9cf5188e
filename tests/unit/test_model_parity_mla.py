"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, grouped top-k experts, shared experts):
greedy tokens from ModelRunner equal transformers' generate(do_sample=False), float32, CPU, for tiny
random models built from transformers' own config classes and saved as safetensors; chunked prefills,
a NaN-poisoned cache and decodes of different lengths share steps (test_model_parity's schedule).
The cache holds one latent row per token and layer; the Triton MLA kernel inside a real forward
gives the same tokens; configs that break their own rules are refused in one line."""

from support.kernel_device import DEVICE, MARKS  # first: it decides TRITON_INTERPRET before triton loads

import json

import pytest
import torch

from pagedserve.kernels import cpu_native, triton_ops
from pagedserve.protocol.model_architectures import ModelConfigError, check_model_config
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_config import UnsupportedModelError, load_model_spec
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models.deepseek import DeepseekMoeBlock, MlaDecoderLayer
from support.worker_harness import TrivialScheduler, hf_greedy, random_prompts
from test_model_parity import PROMPT_LENGTHS, assert_equal_to_oracle, run_mixed_schedule

HEADS = dict(num_heads=4, num_kv_heads=4)  # transformers' MLA repeats no KV heads: the two counts agree
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=256,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)  # both the cos/sin and the softmax scaled

CASES = {
    # q_proj (no q_lora_rank), complex-pair rotary, softmax routing limited to 2 of 4 groups, a shared
    # expert; layer 0 dense
    "v2_group_limited_greedy": dict(arch="deepseek_v2", num_layers=3, seed=11),
    # q_a / q_b with its norm, greedy routing over every expert, two shared experts, every layer sparse,
    # YaRN (DeepSeek-V2's released configs use it): its attention factor on the complex pairs, its mscale
    "v2_greedy_q_lora_yarn": dict(arch="deepseek_v2", num_layers=2, q_lora_rank=24, topk_method="greedy",
                                  n_shared_experts=2, first_k_dense_replace=0, rope_parameters=YARN, seed=2),
    # interleaved rotary, sigmoid scores with a random correction bias, grouped by their two best,
    # norm_topk_prob, routed_scaling_factor
    "v3_default": dict(arch="deepseek_v3", num_layers=3, seed=3),
    # rotary as halves, no renormalisation, and YaRN: its mscale_all_dim in the softmax scale
    "v3_halves_yarn_no_norm_topk": dict(arch="deepseek_v3", num_layers=2, rope_interleave=False, norm_topk_prob=False,
                                        rope_parameters=YARN, seed=4),
    # q_lora_rank None in V3, one group (no group limit)
    "v3_no_q_lora_one_group": dict(arch="deepseek_v3", num_layers=2, q_lora_rank=None, n_group=1, topk_group=1,
                                   seed=5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_of_deepseek_equal_transformers(tmp_path, case):
    model_dir = build_model_dir(tmp_path / case, **HEADS, **CASES[case])
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    runner = ModelRunner(str(model_dir))
    layers = runner.model.layers
    assert all(isinstance(layer, MlaDecoderLayer) for layer in layers)
    assert [isinstance(layer.moe, DeepseekMoeBlock) for layer in layers] == list(runner.spec.moe.sparse_layers)
    got = run_mixed_schedule(runner, prompts, poison=True)
    assert_equal_to_oracle(model_dir, got, prompts)


def test_the_cache_holds_one_latent_row_per_token_and_layer(tmp_path):
    """kv_lora_rank 28 + rope 4 = 32 numbers a token and layer, where per-head K and V would be
    4 x (12 + 4) + 4 x 12 = 112: the block manager's blocks are sized from the family's spec."""
    model_dir = build_model_dir(tmp_path / "m", **HEADS, **CASES["v3_default"])
    runner = ModelRunner(str(model_dir))
    scheduler = TrivialScheduler(runner, block_size=4)
    cache = runner.kv_cache
    layers, blocks = runner.spec.num_layers, cache.shape[2]
    assert cache.shape == (layers, 1, blocks, 4, 1, 32)
    assert runner.block_bytes(16) == layers * 16 * 32 * 4
    assert runner.max_gpu_blocks(16, memory_bytes=10 * runner.block_bytes(16)) == 10
    # the rows the step writes are exactly the latent: kv_a_layernorm(c) then the rotated k_rope
    prompt = random_prompts([6], vocab_size=512, seed=1)[0]
    scheduler.add("r", prompt, 1)
    scheduler.run()
    assert cache[:, 0, :, :, 0].isfinite().any(dim=-1).sum() >= layers * len(prompt)


def test_the_native_decode_kernel_serves_the_latent_attention(tmp_path, monkeypatch):
    """Decodes through the native kernel (the latent row as K and V), prompt chunks expanded."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler on this machine")
    calls = []
    kernel = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda *a, **kw: calls.append(a) or kernel(*a, **kw))
    model_dir = build_model_dir(tmp_path / "m", **HEADS, **CASES["v2_group_limited_greedy"])
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=7)
    got = run_mixed_schedule(ModelRunner(str(model_dir)), prompts)
    assert calls and all(query.shape[2] == 32 for query, *_ in calls)
    assert_equal_to_oracle(model_dir, got, prompts)


@pytest.mark.parametrize("case", ["v2_group_limited_greedy", "v3_default"])
def test_greedy_tokens_through_the_triton_mla_kernel_equal_transformers(tmp_path, monkeypatch, case):
    for mark in MARKS:
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    model_dir = str(build_model_dir(tmp_path / "m", **HEADS, **CASES[case]))
    calls = []
    kernel = triton_ops.mla_attention
    monkeypatch.setattr(triton_ops, "mla_attention", lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    runner = ModelRunner(model_dir, device=str(DEVICE), cuda_graphs=False)
    assert runner.ops is triton_ops
    prompts = random_prompts([11, 6], vocab_size=512, seed=2)
    scheduler = TrivialScheduler(runner)
    scheduler.add("chunked", prompts[0], 8, prefill_chunks=[5])  # a chunk over cached latent rows
    scheduler.add("late", prompts[1], 8, arrival_step=1)  # a prefill beside a decode
    outputs = scheduler.run()
    assert [outputs["chunked"], outputs["late"]] == hf_greedy(model_dir, prompts, 8)
    assert calls and max(calls) > 2


def rewrite(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("arch, changes, message", [
    ("deepseek_v3", dict(num_experts_per_tok=9), "num_experts_per_tok=9 needs between 1 and n_routed_experts=8"),
    ("deepseek_v3", dict(n_group=3), "n_routed_experts=8 in n_group=3 groups with topk_group=2: the groups must"),
    ("deepseek_v3", dict(topk_group=5), "topk_group=5: the groups must split the experts evenly and topk_group be"),
    ("deepseek_v3", dict(num_experts_per_tok=5), "num_experts_per_tok=5 is more than the topk_group=2 groups of 2"),
    ("deepseek_v3", dict(n_group=8, topk_group=4), "n_group=8 leaves 1 in each"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported"),
])
def test_a_deepseek_config_that_breaks_its_own_rules_is_refused_in_one_line(tmp_path, arch, changes, message):
    model_dir = rewrite(build_model_dir(tmp_path / "m", arch, **HEADS), **changes)
    with pytest.raises(ModelConfigError) as refused:
        check_model_config(model_dir)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UnsupportedModelError):  # the worker refuses it too, by the same check
        load_model_spec(model_dir)


@pytest.mark.parametrize("changes, message", [(dict(attention_bias=True), "attention_bias=true is not supported"),
                                              (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported")])
def test_a_deepseek_setting_the_worker_cannot_compute_is_refused_in_one_line(tmp_path, changes, message):
    model_dir = rewrite(build_model_dir(tmp_path / "m", "deepseek_v2", **HEADS), **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_spec(model_dir)


def test_lora_on_latent_attention_is_refused_in_one_line(tmp_path):
    from pagedserve.worker_proc.models.lora_linear import LoRAConfig

    model_dir = build_model_dir(tmp_path / "m", "deepseek_v2", **HEADS)
    with pytest.raises(UnsupportedModelError, match="LoRA adapters are not supported on latent attention"):
        ModelRunner(str(model_dir), lora=LoRAConfig(max_loras=1, max_rank=8))
