"""Families with no native file, run by the transformers backend: greedy tokens equal transformers'
(float32, CPU) with chunked prefill, mixed decodes, a poisoned cache and prefix caching; and what
the backend refuses, in one line."""

from __future__ import annotations

import pytest

from pagedserve.protocol.messages import SamplingParams
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.model_impl import select_implementation
from pagedserve.worker_proc.model_runner import ModelRunner
from pagedserve.tools.in_process_engine import generate
from support.worker_harness import TrivialScheduler, hf_greedy, random_prompts

NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 19, 33, 9, 2]

CASES = {
    "stablelm": dict(arch="stablelm"),  # partial rotary, LayerNorm with biases, parallel q/k/v
    "starcoder2": dict(arch="starcoder2"),
    "starcoder2_sliding_window_8": dict(arch="starcoder2", sliding_window=8, seed=3),
    "cohere": dict(arch="cohere", seed=1),  # logit scale in the head, parallel attention and MLP
    "smollm3": dict(arch="smollm3", seed=2),  # no rotary on every fourth layer
    "glm4": dict(arch="glm4", seed=4),  # half rotary, interleaved; post-norms
}


def run_mixed_schedule(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Prompts arrive at different steps, two in chunks; decodes of different lengths and prefill
    chunks share steps; a late request reuses freed, stale blocks of a NaN-poisoned cache."""
    scheduler = TrivialScheduler(runner, block_size=4)
    runner.poison_cache()
    scheduler.add("r0", prompts[0], NEW_TOKENS)
    scheduler.add("r1", prompts[1], NEW_TOKENS, prefill_chunks=[7])
    scheduler.add("r2", prompts[2], NEW_TOKENS, arrival_step=2, prefill_chunks=[10, 11])
    scheduler.add("r3", prompts[3], NEW_TOKENS, arrival_step=5)
    scheduler.add("r4", prompts[4], NEW_TOKENS, arrival_step=16)
    outputs = scheduler.run()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("case", list(CASES))
def test_a_family_without_a_native_file_gives_transformers_greedy_tokens_through_the_backend(tmp_path, case):
    model_dir = build_model_dir(tmp_path / case, **CASES[case])
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    runner = ModelRunner(str(model_dir))  # auto: no native family, so the backend
    assert runner.model_impl == f"transformers backend ({runner.spec.architecture})"
    got = run_mixed_schedule(runner, prompts)
    for prompt, ours, theirs in zip(prompts, got, hf_greedy(model_dir, prompts, NEW_TOKENS)):
        assert ours == theirs, f"prompt of {len(prompt)} tokens diverged"


def test_a_sliding_window_reaches_the_paged_attention_of_each_layer(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "starcoder2", sliding_window=8)
    assert ModelRunner(str(model_dir)).spec.layer_sliding_windows == (8, 8)


@pytest.mark.parametrize("arch", ["starcoder2", "cohere"])
def test_prompts_sharing_cached_prefixes_in_small_chunks_give_transformers_tokens(tmp_path, arch):
    """A real scheduler with prefix caching on: later prompts start from blocks earlier ones computed,
    and every prompt is prefilled in chunks of at most 8 tokens beside the others' decodes."""
    model_dir = build_model_dir(tmp_path / arch, arch, seed=7)
    shared = random_prompts([24], vocab_size=512, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts([3, 7, 1, 12], vocab_size=512, seed=9)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    streams, sched = generate(str(model_dir), prompts, [greedy] * len(prompts), enable_prefix_caching=True,
                              max_num_batched_tokens=8, max_num_seqs=3)
    assert sched.stats()["prefix_cache_hits"] >= 3 * 24 // 4 * 4  # each later prompt reuses the shared blocks
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    for i, theirs in enumerate(expected):
        assert streams[(f"r{i}", 0)] == theirs, f"prompt {i} diverged"


def test_the_backend_runs_a_native_family_too_with_the_native_tokens(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "llama")
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=2)
    native = ModelRunner(str(model_dir))
    assert native.model_impl == "native (LlamaForCausalLM)"
    backend = ModelRunner(str(model_dir), model_impl="transformers")
    assert backend.model_impl == "transformers backend (LlamaForCausalLM)"
    assert backend.model_id != native.model_id  # a trace names the implementation that computed it
    assert run_mixed_schedule(backend, prompts) == run_mixed_schedule(native, prompts)


def test_gpt_oss_attention_sinks_run_through_the_backend_with_transformers_tokens(tmp_path):
    """gpt-oss's sinks (``s_aux``) reach the paged attention from transformers' own modeling code: the
    backend gives transformers' tokens, and the native family's."""
    model_dir = build_model_dir(tmp_path / "m", "gpt_oss", num_layers=3, intermediate_size=48, swiglu_limit=1.5,
                                seed=4)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=6)
    backend = ModelRunner(str(model_dir), model_impl="transformers")
    assert backend.model_impl == "transformers backend (GptOssForCausalLM)"
    got = run_mixed_schedule(backend, prompts)
    assert got == run_mixed_schedule(ModelRunner(str(model_dir)), prompts)
    for prompt, ours, theirs in zip(prompts, got, hf_greedy(model_dir, prompts, NEW_TOKENS)):
        assert ours == theirs, f"prompt of {len(prompt)} tokens diverged"


def test_native_refuses_a_family_it_has_no_file_for_and_names_the_ones_it_has(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "glm4")
    with pytest.raises(UnsupportedModelError, match="Glm4ForCausalLM.*is not supported.*LlamaForCausalLM"):
        select_implementation(model_dir, "native")


def _config_only(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_state_space_model_is_refused_in_one_line_saying_why(tmp_path):
    from transformers import FalconH1Config

    config = FalconH1Config(num_hidden_layers=2, hidden_size=64, vocab_size=512, architectures=["FalconH1ForCausalLM"])
    with pytest.raises(UnsupportedModelError) as refusal:
        select_implementation(_config_only(tmp_path, config), "auto")
    message = str(refusal.value)
    assert "\n" not in message and "natively:" in message and "transformers backend" in message


def test_attention_logit_soft_capping_is_refused_rather_than_computed_wrongly(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, architectures=["Gemma2ForCausalLM"])
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM asks for attention logit soft-capping"):
        ModelRunner(str(tmp_path), model_impl="transformers")


def test_tensor_parallelism_is_refused_for_the_backend_in_one_line(tmp_path):
    from pagedserve.worker_proc.model_config import ModelSpec  # noqa: F401  (the spec is the backend's)
    from pagedserve.worker_proc.models.transformers_backend import TransformersCausalLM, load_backend_spec
    from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
    import torch

    model_dir = build_model_dir(tmp_path / "m", "starcoder2")
    spec = load_backend_spec(model_dir)
    shard = TensorParallelShard.for_rank(spec, 0, 2)
    with pytest.raises(UnsupportedModelError, match="tensor-parallel size 2 is not supported"):
        TransformersCausalLM(str(model_dir), spec, shard, torch.device("cpu"), torch.float32)
