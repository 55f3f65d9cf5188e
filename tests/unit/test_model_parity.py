"""Greedy tokens from ModelRunner equal transformers' generate(do_sample=False), float32, CPU."""

from __future__ import annotations

import pytest
import torch

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler, hf_greedy, random_prompts

NEW_TOKENS = 14
PROMPT_LENGTHS = [5, 19, 33, 9, 2]

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}

# Short factors up to 512 positions (every sequence here), scaled by longrope's attention factor
# (2048 / 512 positions: sqrt(1 + ln 4 / ln 512)); the served length stops there (rotary.py)
PHI3_LONGROPE = dict(original_max_position_embeddings=512, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [4.0 + 2.0 * i for i in range(8)],
})

CASES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen2_tied_embeddings": dict(arch="qwen2", tie_word_embeddings=True, seed=5),
    "qwen3": dict(arch="qwen3", seed=1),
    "mistral_sliding_window_8": dict(arch="mistral", sliding_window=8, seed=2),
    "llama_multi_query_llama3_rope": dict(arch="llama", num_kv_heads=1, rope_parameters=LLAMA3_ROPE, seed=4),
    # head dims the native prompt-attention kernel takes (multiples of 32): fresh prompts and
    # the chunks after the first, on their cached context
    "qwen2_head_dim_32": dict(arch="qwen2", hidden_size=128, seed=6),
    "llama_head_dim_64_multi_query": dict(arch="llama", hidden_size=256, num_heads=4, num_kv_heads=1, seed=10),
    # The families beyond Llama's (models/<family>.py), each with norm weights off their init value.
    # Gemma's window (8) is shorter than most prompts and than every prompt with its output.
    "gemma2_softcaps_sandwich_norms_window_8": dict(arch="gemma2", norm_std=0.1, seed=20),
    "gemma3_qk_norm_local_rope_base_window_8": dict(arch="gemma3", norm_std=0.1, seed=21),
    "phi3_fused_qkv_and_gate_up": dict(arch="phi3", norm_std=0.1, seed=22),
    "phi3_longrope": dict(arch="phi3", norm_std=0.1, seed=23, **PHI3_LONGROPE),
    "phi3_partial_rotary_as_phi4_mini": dict(arch="phi3", norm_std=0.1, seed=26, partial_rotary_factor=0.75),
    "olmo2_post_norms_projection_qk_norm": dict(arch="olmo2", norm_std=0.1, seed=24),
    "granite_multipliers": dict(arch="granite", norm_std=0.1, seed=25),
}


def run_mixed_schedule(runner: ModelRunner, prompts: list[list[int]], poison: bool = False,
                       block_size: int = 4) -> list[list[int]]:
    """Prompts arrive at different steps; two are prefilled in chunks; decodes of
    different lengths and prefill chunks share batches."""
    scheduler = TrivialScheduler(runner, block_size=block_size)
    if poison:
        runner.poison_cache()
    scheduler.add("r0", prompts[0], NEW_TOKENS)
    scheduler.add("r1", prompts[1], NEW_TOKENS, prefill_chunks=[7])
    scheduler.add("r2", prompts[2], NEW_TOKENS, arrival_step=2, prefill_chunks=[10, 11])
    scheduler.add("r3", prompts[3], NEW_TOKENS, arrival_step=5)
    scheduler.add("r4", prompts[4], NEW_TOKENS, arrival_step=16)  # reuses freed, stale blocks
    outputs = scheduler.run()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def assert_equal_to_oracle(model_dir, got: list[list[int]], prompts: list[list[int]]) -> None:
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    for prompt, ours, theirs in zip(prompts, got, expected):
        assert len(theirs) >= 12, "the oracle stopped at EOS too early to compare; change the prompt seed"
        assert ours[: len(theirs)] == theirs, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_with_chunked_prefill_and_mixed_decodes(tmp_path, case):
    model_dir = build_model_dir(tmp_path / case, **CASES[case])
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=len(case))
    got = run_mixed_schedule(ModelRunner(str(model_dir)), prompts)
    assert_equal_to_oracle(model_dir, got, prompts)


def test_a_nan_poisoned_cache_with_zeroed_new_blocks_still_matches_transformers(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "qwen2")
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=11)
    runner = ModelRunner(str(model_dir))
    got = run_mixed_schedule(runner, prompts, poison=True)
    assert_equal_to_oracle(model_dir, got, prompts)


def test_the_block_size_does_not_change_the_tokens(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "llama")
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=5)
    by_block_size = [run_mixed_schedule(ModelRunner(str(model_dir)), prompts, block_size=b) for b in (1, 16)]
    assert by_block_size[0] == by_block_size[1]


def test_a_sharded_checkpoint_with_an_index_loads_like_a_single_file(tmp_path):
    from transformers import AutoModelForCausalLM

    single = build_model_dir(tmp_path / "single", "qwen3")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(single)).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    prompts = random_prompts([7, 12], vocab_size=512, seed=9)
    outputs = []
    for model_dir in (single, sharded):
        scheduler = TrivialScheduler(ModelRunner(str(model_dir)))
        scheduler.add("a", prompts[0], 6)
        scheduler.add("b", prompts[1], 6)
        outputs.append(scheduler.run())
    assert outputs[0] == outputs[1]


BF16_LOGIT_TOLERANCE = 0.15  # measured 0.08 against transformers' bf16; its own bf16 is 0.26 off its fp32


def test_bfloat16_logits_match_transformers_in_bfloat16_and_so_do_greedy_tokens_with_a_clear_margin(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_model_dir(tmp_path / "m", "qwen2")
    runner = ModelRunner(str(model_dir), dtype="bfloat16")
    step_logits = []
    compute_logits = runner.model.compute_logits

    def recording_compute_logits(hidden):  # records what the real method returns, changes nothing
        logits = compute_logits(hidden)
        step_logits.append(logits.clone())
        return logits

    runner.model.compute_logits = recording_compute_logits
    scheduler = TrivialScheduler(runner)
    prompt = random_prompts([9], vocab_size=512)[0]
    scheduler.add("a", prompt, 16, prefill_chunks=[4])
    tokens = scheduler.run()["a"]
    assert runner.kv_cache.dtype == torch.bfloat16
    ours = torch.cat(step_logits)
    # transformers in bf16 over the same tokens (teacher forcing: one divergent argmax cannot
    # shift every later comparison), the logits that predicted each of our tokens
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    assert ours.shape == theirs.shape == (16, 512)
    assert (ours - theirs).abs().max() < BF16_LOGIT_TOLERANCE
    top2 = theirs.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_LOGIT_TOLERANCE
    assert clear.sum() >= 6, "too few clear margins to compare tokens; change the prompt seed"
    assert torch.equal(torch.tensor(tokens)[clear], theirs.argmax(-1)[clear])


# (PAGEDSERVE_CPU_PACKED_LINEAR, PAGEDSERVE_CPU_NATIVE_LINEAR, cache-resident, transposed copy kept)
# -> the layout expected: (packed copy, [out, in] weight, [in, out] copy, resident, native panels)
WEIGHT_LAYOUTS = {
    "cached_copy": ("", "0", True, True, (False, True, True, True, False)),
    "cached_copy_and_packed": ("1", "0", True, True, (True, True, True, True, False)),
    "streamed_packed_and_plain": ("", "0", False, True, (True, True, False, False, False)),
    "streamed_packed_only": ("", "0", False, False, (True, False, False, False, False)),
    "streamed_copy_onemkl": ("0", "0", False, True, (False, True, True, False, False)),
    "weight_only_onemkl": ("0", "0", False, False, (False, True, False, False, False)),
    "native_panels": ("", "1", False, True, (False, False, False, False, True)),
    "native_panels_and_cached_copy": ("", "1", True, True, (False, False, True, True, True)),
}


@pytest.mark.parametrize("layout", list(WEIGHT_LAYOUTS))
def test_decode_steps_of_many_rows_equal_transformers_in_every_weight_layout(tmp_path, monkeypatch, layout):
    """40 requests decode together, so steps have more rows than the few-row matmul paths
    take: they run the native kernel, oneDNN's packed weight, x @ W_t or F.linear; the last steps,
    with few rows left, run x @ W_t (a cache-resident model), W @ x.T, the native kernel or the
    packed weight (kept alone)."""
    from pagedserve.kernels import cpu_native
    from pagedserve.worker_proc.models import linear

    packed_env, native_env, resident, transposed, expected_layout = WEIGHT_LAYOUTS[layout]
    if native_env == "1" and not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here (it needs AVX2 and FMA, and a C compiler)")
    monkeypatch.setenv(linear.PACKED_ENV, packed_env)
    monkeypatch.setenv(linear.NATIVE_ENV, native_env)
    monkeypatch.setattr(linear, "TRANSPOSED_COPY_MAX_BYTES", linear.TRANSPOSED_COPY_MAX_BYTES if transposed else 0)
    monkeypatch.setattr(linear, "CACHE_RESIDENT_MAX_BYTES", linear.CACHE_RESIDENT_MAX_BYTES if resident else 0)
    model_dir = build_model_dir(tmp_path / "m", "qwen2", seed=6)
    prompts = random_prompts([3 + i % 11 for i in range(40)], vocab_size=512, seed=13)
    runner = ModelRunner(str(model_dir))
    for w in (runner.model.layers[0].gate_up, runner.model.lm_head):
        assert (w.packed is not None, w.weight is not None, w.weight_t is not None, w.resident,
                w.panels is not None) == expected_layout
    scheduler = TrivialScheduler(runner, block_size=4, num_gpu_blocks=512)
    for i, prompt in enumerate(prompts):
        scheduler.add(f"r{i}", prompt, NEW_TOKENS)
    outputs = scheduler.run()
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # Some of 40 random prompts hit EOS early in the oracle: compare what it generated, and
    # require enough long ones that the many-row decode steps really happened.
    assert sum(len(theirs) >= 12 for theirs in expected) >= 33
    for i, theirs in enumerate(expected):
        assert outputs[f"r{i}"][: len(theirs)] == theirs, f"prompt {i} diverged"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_a_random_model_is_a_function_of_its_seed_alone(tmp_path, arch):
    """The golden traces rebuild their model from a seed: its bytes must not depend on torch's
    global generator or on how the installed transformers initializes a model."""
    torch.manual_seed(0)
    first = build_model_dir(tmp_path / "a", arch, seed=7)
    torch.manual_seed(99)
    second = build_model_dir(tmp_path / "b", arch, seed=7)
    other = build_model_dir(tmp_path / "c", arch, seed=8)
    weights = [(p / "model.safetensors").read_bytes() for p in (first, second, other)]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    state = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(first / "model.safetensors"))
    assert all(t.abs().max() == 0 for name, t in state.items() if name.endswith("bias"))
    assert all(torch.equal(t, torch.ones_like(t)) for name, t in state.items() if name.endswith("norm.weight"))


def test_a_bfloat16_checkpoint_computed_in_float32_keeps_bfloat16_panels_and_transformers_tokens(tmp_path,
                                                                                               monkeypatch):
    """The native kernel widens the checkpoint's bfloat16 weights exactly: the float32 model holds
    half the weight bytes and still gives transformers' float32 greedy tokens."""
    from pagedserve.kernels import cpu_native
    from pagedserve.worker_proc.models import linear

    if not cpu_native.supports_linear():
        pytest.skip("no native linear kernel here (it needs AVX2 and FMA, and a C compiler)")
    monkeypatch.setenv(linear.NATIVE_ENV, "1")
    monkeypatch.setattr(linear, "CACHE_RESIDENT_MAX_BYTES", 0)  # every row count through the panels
    model_dir = build_model_dir(tmp_path / "m", "qwen2", seed=8, dtype="bfloat16")
    prompts = random_prompts([3 + i % 11 for i in range(12)], vocab_size=512, seed=17)
    runner = ModelRunner(str(model_dir), dtype="float32")
    for w in (runner.model.layers[0].qkv, runner.model.layers[1].down, runner.model.lm_head):
        assert w.panels.dtype == torch.bfloat16 and w.weight is None
    scheduler = TrivialScheduler(runner, block_size=4, num_gpu_blocks=512)
    for i, prompt in enumerate(prompts):
        scheduler.add(f"r{i}", prompt, NEW_TOKENS)
    outputs = scheduler.run()
    for i, theirs in enumerate(hf_greedy(model_dir, prompts, NEW_TOKENS)):
        assert outputs[f"r{i}"][: len(theirs)] == theirs, f"prompt {i} diverged"
