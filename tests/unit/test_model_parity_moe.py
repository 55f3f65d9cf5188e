"""Mixtures of experts: greedy tokens from ModelRunner equal transformers' generate(do_sample=False),
float32, CPU, for tiny random Mixtral, Qwen2-MoE and Qwen3-MoE models saved as safetensors and
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


def test_bfloat16_experts_stay_close_to_transformers_bfloat16_logits(tmp_path):
    """bfloat16 takes the dense layers' bf16 path per expert (oneDNN's packed weights on
    AVX512-BF16); its logits stay within the dense model's bf16 tolerance of transformers' (over
    our own tokens: teacher forcing)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_model_dir(tmp_path / "m", **CASES["qwen3_moe_norm_topk_prob"])
    runner = ModelRunner(str(model_dir), dtype="bfloat16")
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
