"""Mixtures of experts: greedy tokens from ModelRunner equal transformers' generate(do_sample=False),
float32, CPU, for tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss models saved as safetensors and
loaded through the real path; chunked prefills and decodes of different lengths share steps, so
an expert's rows mix tokens of several requests."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.protocol.model_architectures import ModelConfigError
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.worker_proc.models.moe import SparseMoeBlock
from support.worker_harness import TrivialScheduler, random_prompts
from test_model_parity import NEW_TOKENS, assert_equal_to_oracle

PROMPT_LENGTHS = [5, 19, 33, 9]

CASES = {
    "mixtral": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2),
    # a shared expert with its sigmoid gate; layer 1 is a dense MLP (mlp_only_layers), layer 2 is
    # sparse again; no renormalisation of the top-k
    "qwen2_moe_shared_expert_and_a_dense_layer": dict(
        arch="qwen2_moe", num_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, mlp_only_layers=[1], seed=1),
    "qwen3_moe_norm_topk_prob": dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                     norm_topk_prob=True, seed=2),
    "qwen3_moe_every_second_layer_sparse": dict(arch="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                                                moe_intermediate_size=32, decoder_sparse_step=2, seed=3),
    # attention sinks, biases on q/k/v/o, router and experts drawn at random; layers 0 and 2 slide a
    # window of 8 (shorter than the prompts), layer 1 sees everything; YaRN; the clamped SwiGLU's limit
    # low enough that random products reach it; 4 experts, top 2 by a softmax over the top logits
    "gpt_oss_sinks_windows_yarn_clamped_swiglu": dict(arch="gpt_oss", num_layers=3, intermediate_size=48,
                                                      swiglu_limit=1.5, seed=4),
}


def run(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    scheduler = TrivialScheduler(runner, block_size=4)
    for i, prompt in enumerate(prompts):
        scheduler.add(f"r{i}", prompt, NEW_TOKENS, prefill_chunks=[7] if i == 1 else None, arrival_step=2 * i)
    outputs = scheduler.run()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_of_a_mixture_of_experts_equal_transformers(tmp_path, case):
    model_dir = build_model_dir(tmp_path / case, **CASES[case])
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    runner = ModelRunner(str(model_dir))
    sparse = [isinstance(layer.moe, SparseMoeBlock) for layer in runner.model.layers]
    assert sparse == list(runner.spec.moe.sparse_layers) and any(sparse)
    assert_equal_to_oracle(model_dir, run(runner, prompts), prompts)


def test_the_experts_on_native_panels_give_transformers_tokens(tmp_path, monkeypatch):
    """Every row count through cpu_linear.c's panels (where the dense layers take them: AVX2 without
    AVX-512, or the switch), each expert's SiLU gate in its gate_up call."""
    from pagedserve.kernels import cpu_native
    from pagedserve.worker_proc.models import linear

    if not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here (it needs AVX2 and FMA, and a C compiler)")
    monkeypatch.setenv(linear.NATIVE_ENV, "1")
    monkeypatch.setattr(linear, "CACHE_RESIDENT_MAX_BYTES", 0)
    model_dir = build_model_dir(tmp_path / "m", **CASES["qwen2_moe_shared_expert_and_a_dense_layer"])
    runner = ModelRunner(str(model_dir))
    block = runner.model.layers[0].moe
    assert block.experts[0][0].panels is not None and block.shared[0].panels is not None
    assert block.kernel.startswith("grouped by expert: native matmuls")
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=21)
    assert_equal_to_oracle(model_dir, run(runner, prompts), prompts)


def test_a_checkpoint_with_transformers_fused_expert_tensors_loads_like_the_per_expert_one(tmp_path):
    """transformers 5 keeps the experts as [E, 2I, H] / [E, H, I] tensors (mlp.experts.gate_up_proj)
    and writes the hub's per-expert names on save; a file holding the fused names loads too."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    per_expert = build_model_dir(tmp_path / "per_expert", **CASES["mixtral"])
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in per_expert.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    state = AutoModelForCausalLM.from_pretrained(str(per_expert)).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
    prompts = random_prompts([7, 12], vocab_size=512, seed=9)
    outputs = [run(ModelRunner(str(d)), prompts) for d in (per_expert, fused)]
    assert outputs[0] == outputs[1]


def test_a_config_routing_to_more_experts_than_it_has_is_refused_at_start_in_one_line(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", **CASES["mixtral"])
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"^config.json: num_experts_per_tok=9 needs between 1 and "
                                               r"num_local_experts=8 experts to pick from$"):
        ModelRunner(str(model_dir))


@pytest.mark.parametrize("path", ["one call", "per expert"])
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe_norm_topk_prob", "gpt_oss_sinks_windows_yarn_clamped_swiglu"])
def test_bfloat16_experts_stay_close_to_transformers_bfloat16_logits(tmp_path, monkeypatch, case, path):
    """bfloat16 takes one native call per layer for the experts (kernels/cpu_moe.c) on AVX512-BF16 (here under
    PAGEDSERVE_CPU_MOE_KERNEL=1 wherever the library is built), or,
    with PAGEDSERVE_CPU_MOE_KERNEL=0, the dense layers' bf16 path per expert (oneDNN's packed weights on
    AVX512-BF16); either's logits stay within the dense model's bf16 tolerance of transformers' (over our own
    tokens: teacher forcing). Mixtral: float32 routing weights; gpt-oss: its sinks, biases and clamped SwiGLU."""
    from transformers import AutoModelForCausalLM

    from pagedserve.kernels import cpu_native
    from pagedserve.worker_proc.models.moe import MOE_KERNEL_ENV

    if path == "one call" and cpu_native.library() is None:
        pytest.skip("the experts' kernel needs the native library")
    monkeypatch.setenv(MOE_KERNEL_ENV, "1" if path == "one call" else "0")
    model_dir = build_model_dir(tmp_path / "m", **CASES[case])
    runner = ModelRunner(str(model_dir), dtype="bfloat16")
    assert all((layer.moe.native is not None) == (path == "one call") for layer in runner.model.layers if layer.moe)
    step_logits = []
    compute_logits = runner.model.compute_logits

    def recording_compute_logits(hidden):
        logits = compute_logits(hidden)
        step_logits.append(logits.clone())
        return logits

    runner.model.compute_logits = recording_compute_logits
    scheduler = TrivialScheduler(runner)
    prompt = random_prompts([9], vocab_size=512, seed=4)[0]
    scheduler.add("a", prompt, 12, prefill_chunks=[4])
    tokens = scheduler.run()["a"]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    ours = torch.cat(step_logits)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 0.15  # the dense model's bf16 tolerance; measured 0.08


def test_a_tensor_parallel_size_that_does_not_divide_the_experts_is_refused_in_one_line(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", **{**CASES["qwen3_moe_norm_topk_prob"], "moe_intermediate_size": 50})
    with pytest.raises(UnsupportedModelError, match=r"^tensor-parallel size 4 does not divide moe_intermediate_size=50;"
                                                    r" pick a tp_size that does$"):
        ModelRunner(str(model_dir), tp_rank=0, tp_size=4)


def test_the_worker_refuses_expert_parallelism_that_cannot_place_the_experts_in_one_line(tmp_path):
    """serve refuses both first (tests/e2e/test_expert_parallel.py); a worker started by hand says the same."""
    uneven = build_model_dir(tmp_path / "m", "mixtral", num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match=r"^--enable-expert-parallel: tensor-parallel size 2 does not "
                                                    r"divide the 3 experts; pick a tp_size that does$"):
        ModelRunner(str(uneven), tp_rank=0, tp_size=2, expert_parallel=True)
    dense = build_model_dir(tmp_path / "d", "qwen2")
    with pytest.raises(UnsupportedModelError, match=r"^--enable-expert-parallel: Qwen2ForCausalLM has no mixture "
                                                    r"of experts to place$"):
        ModelRunner(str(dense), tp_rank=0, tp_size=2, expert_parallel=True)


def test_gpt_oss_experts_from_the_interleaved_checkpoint_equal_transformers_experts(tmp_path):
    """The checkpoint's gate_up [E, H, 2I] with gate and up columns interleaved, laid out by the
    family's loader, through the torch reference and the CPU grouped path (biases, clamped SwiGLU, a
    tensor-parallel half each): transformers' own GptOssExperts on the same tensors, and the limit binds."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from pagedserve.kernels import moe_reference
    from pagedserve.kernels.moe_routing import RoutingRule, route
    from pagedserve.worker_proc.elementwise import TorchElementwise
    from pagedserve.worker_proc.models.gpt_oss import read_experts
    from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout
    from pagedserve.worker_proc.models.moe import grouped_experts
    from pagedserve.worker_proc.weights import WeightSource
    from safetensors.torch import save_file

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                          swiglu_limit=1.0)
    config._experts_implementation = "eager"
    experts, router = GptOssExperts(config), GptOssTopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in [*experts.parameters(), *router.parameters()]:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    x = torch.randn(9, 32, generator=generator)
    with torch.no_grad():
        _, scores, ids = router(x)
        theirs = experts(x, ids, scores)
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 1.0).any() and (gate_up[:, 1::2].abs() > 1.0).any()  # the clamps bind
    weights, ours_ids = route(torch.nn.functional.linear(x, router.weight, router.bias),
                              RoutingRule(2, softmax_after_topk=True))
    assert torch.equal(ours_ids, ids) and torch.allclose(weights, scores)
    block = "model.layers.0.mlp."
    save_file({block + "experts." + n: p.detach().contiguous() for n, p in experts.named_parameters()},
              str(tmp_path / "model.safetensors"))
    source = WeightSource(str(tmp_path))
    activation = moe_reference.ClampedSwiglu(config.swiglu_alpha, config.swiglu_limit)
    whole = read_experts(source, block, (0, 24))
    reference = moe_reference.fused_moe(x, torch.stack(whole.gate_ups), torch.stack(whole.downs), weights, ids,
                                        torch.stack(whole.gate_up_biases), torch.stack(whole.down_biases), activation)
    torch.testing.assert_close(reference, theirs, rtol=1e-5, atol=1e-5)
    halves = []  # two tensor-parallel ranks: down's bias on the first only
    for rank, part in enumerate([(0, 12), (12, 24)]):
        t = read_experts(source, block, part)
        pairs = [(LinearWeight.of(gu.contiguous(), gub, WeightLayout()),
                  LinearWeight.of(d.contiguous(), db if rank == 0 else None, WeightLayout()))
                 for gu, d, gub, db in zip(t.gate_ups, t.downs, t.gate_up_biases, t.down_biases)]
        halves.append(grouped_experts(x, pairs, weights, ids, TorchElementwise(), activation))
    torch.testing.assert_close(halves[0] + halves[1], theirs, rtol=1e-5, atol=1e-5)
    source.close()


def test_yarn_rotary_tables_equal_transformers_gpt_oss_rotary_embedding(tmp_path):
    """worker_proc/rotary.py's YaRN table (inverse frequencies and the attention factor on cos/sin)
    against GptOssRotaryEmbedding's forward at every position."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from pagedserve.worker_proc.rotary import RotaryEmbedding

    model_dir = build_model_dir(tmp_path / "m", **CASES["gpt_oss_sinks_windows_yarn_clamped_swiglu"])
    config = AutoConfig.from_pretrained(str(model_dir))
    assert config.rope_parameters["rope_type"] == "yarn"
    ours = RotaryEmbedding(config, config.head_dim, 512, torch.device("cpu"), torch.float32)
    theirs = GptOssRotaryEmbedding(config)
    cos, sin = theirs(torch.zeros(1), torch.arange(512)[None])
    assert ours.scaling > 1.0  # YaRN's attention factor scales cos and sin
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])


def test_a_gpt_oss_layer_runs_its_attention_sinks_and_windows(tmp_path):
    """Every layer holds its heads' sinks; the sliding layers their window, the full ones none; the
    experts' log line names the grouped path; zeroed sinks (a model without them) change the tokens."""
    model_dir = build_model_dir(tmp_path / "m", **CASES["gpt_oss_sinks_windows_yarn_clamped_swiglu"])
    runner = ModelRunner(str(model_dir))
    assert [layer.sliding_window for layer in runner.model.layers] == [8, None, 8]
    assert all(layer.sinks is not None and layer.sinks.shape == (4,) for layer in runner.model.layers)
    prompts = random_prompts([21, 30], vocab_size=512, seed=5)
    with_sinks = run(runner, prompts)
    for layer in runner.model.layers:
        layer.sinks = torch.full_like(layer.sinks, float("-inf"))  # exp(-inf) = 0: no sink at all
    assert run(runner, prompts) != with_sinks


def mxfp4_checkpoint(path, seed: int = 0):
    """A gpt-oss model whose experts are stored as the hub stores them: MXFP4 blocks and scales, with
    its quantization_config (attention, router, embeddings and head left in float32)."""
    from safetensors.torch import load_file, save_file

    model_dir = build_model_dir(path, "gpt_oss", num_layers=3, intermediate_size=64, swiglu_limit=1.5, seed=4)
    state = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(name).shape
        state[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator,
                                                dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(122, 126, (experts, outputs, inputs // 32), generator=generator,
                                                dtype=torch.uint8)
    save_file(state, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_gpt_oss_experts_in_mxfp4_as_the_hub_ships_them_give_transformers_tokens(tmp_path):
    """Dequantized at load as transformers' Mxfp4Config(dequantize=True) does (the same values, bit for
    bit), then greedy tokens equal transformers' on that checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedserve.worker_proc.models.gpt_oss import dequantize_mxfp4

    from pagedserve.deploy.serve_config import ServeConfig

    model_dir = mxfp4_checkpoint(tmp_path / "m")
    assert ServeConfig(model=str(model_dir)).model_impl == "auto"  # serve's check before any process starts
    state = load_file(str(model_dir / "model.safetensors"))
    blocks, scales = (state["model.layers.0.mlp.experts.down_proj_" + k] for k in ("blocks", "scales"))
    assert torch.equal(dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=11)
    ours = run(ModelRunner(str(model_dir)), prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, ours):
            ids = torch.tensor([prompt])
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
            assert len(theirs) >= 12 and tokens[:len(theirs)] == theirs


def test_mxfp4_is_refused_in_one_line_for_an_architecture_that_does_not_dequantize_it(tmp_path):
    from pagedserve.protocol.quantization import QuantizationConfigError, parse_quantization_config

    mxfp4 = {"quantization_config": {"quant_method": "mxfp4"}}
    assert parse_quantization_config({**mxfp4, "architectures": ["GptOssForCausalLM"]}) is None
    with pytest.raises(QuantizationConfigError, match=r"^quantization_config: quant_method 'mxfp4' is served for "
                                                      r"GptOssForCausalLM only \(its experts are dequantized at load\)$"):
        parse_quantization_config({**mxfp4, "architectures": ["MixtralForCausalLM"]})
    with pytest.raises(QuantizationConfigError, match="^--quantization compressed-tensors does not match"):
        parse_quantization_config({**mxfp4, "architectures": ["GptOssForCausalLM"]}, "compressed-tensors")


def test_experts_of_a_model_too_large_for_two_layouts_keep_one_copy_and_give_transformers_tokens(tmp_path,
                                                                                                   monkeypatch):
    """Past GEMV_TWO_LAYOUTS_MAX_BYTES the dense layers keep one copy (oneDNN's packed weight in bfloat16, or,
    with PAGEDSERVE_CPU_GEMV=1, the weight as loaded for cpu_gemv.c); the experts, nearly all of a MoE's
    bytes, keep oneDNN's packed weight alone (issue 52: 15.5 GB of them would not fit twice). Float32 under PAGEDSERVE_CPU_GEMV=1 takes that layout here, so the
    tokens are checked exactly; the bfloat16 rule, where AVX512-BF16 makes the panels, keeps one copy too."""
    from pagedserve.kernels import cpu_native
    from pagedserve.worker_proc.models import linear
    from pagedserve.worker_proc.models.moe import expert_layout

    if cpu_native.library() is None or not linear.packed_linear_available(torch.float32):
        pytest.skip("needs the native GEMV library and oneDNN's packed linear")
    monkeypatch.setenv(linear.GEMV_ENV, "1")
    monkeypatch.setattr(linear, "GEMV_TWO_LAYOUTS_MAX_BYTES", 0)
    model_dir = build_model_dir(tmp_path / "m", **CASES["qwen3_moe_norm_topk_prob"])
    runner = ModelRunner(str(model_dir))
    gate_up, down = runner.model.layers[0].moe.experts[0]
    for w in (gate_up, down):
        assert w.packed is not None and w.weight is None and w.gemv_panels is None
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=23)
    assert_equal_to_oracle(model_dir, run(runner, prompts), prompts)
    monkeypatch.delenv(linear.GEMV_ENV)
    if cpu_native.supports_gemv_panels() and linear.packed_linear_available(torch.bfloat16):
        layout = expert_layout(linear.weight_layout(torch.device("cpu"), 5 << 30, torch.bfloat16), torch.bfloat16)
        w = linear.LinearWeight.of(torch.randn(96, 64).bfloat16(), None, layout, gate_size=48)
        assert w.packed is not None and w.weight is None and w.gemv_panels is None
