"""The Triton paged-attention kernel inside a real forward pass: interpreted on CPU, or on a GPU.

On CPU the worker normally attends with its torch paths (batched decodes, SDPA prefill chunks),
so only PAGEDSERVE_KERNELS=triton sends a real model's attention through the kernel there.
On CUDA (see kernel_device) the worker picks the kernel anyway; the setting changes nothing.
"""

from support.kernel_device import DEVICE, MARKS  # first: it decides TRITON_INTERPRET before triton loads

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.kernels import triton_ops
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler, hf_greedy, random_prompts

pytestmark = MARKS

NEW_TOKENS = 4


def test_greedy_tokens_through_the_triton_attention_kernel_equal_transformers(tmp_path, monkeypatch):
    model_dir = str(build_model_dir(tmp_path / "m", "llama", num_layers=2))
    calls = []
    kernel = triton_ops.paged_attention

    def counted_paged_attention(*args, **kwargs):  # counts, then runs the real kernel
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_attention", counted_paged_attention)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    # Eager: a replayed CUDA graph never calls the Python kernel function, and capture calls it
    # once per batch size; test_worker_cuda_graphs.py covers the graphs.
    runner = ModelRunner(model_dir, device=str(DEVICE), cuda_graphs=False)
    assert runner.ops is triton_ops
    prompts = random_prompts([11, 6], vocab_size=512, seed=2)
    scheduler = TrivialScheduler(runner)
    scheduler.add("chunked", prompts[0], NEW_TOKENS, prefill_chunks=[5])  # a chunk over cached K/V
    scheduler.add("late", prompts[1], NEW_TOKENS, arrival_step=1)  # a prefill beside a decode
    outputs = scheduler.run()
    assert [outputs["chunked"], outputs["late"]] == hf_greedy(model_dir, prompts, NEW_TOKENS)
    # every step's first layer, prefills and decodes; the last layer only where a row samples
    # (input_batch.OutputRows): step 1's first chunk of "chunked" samples nothing
    assert scheduler.step < len(calls) < 2 * scheduler.step and max(calls) > 2


def test_gemma2s_soft_capped_windowed_attention_through_the_triton_kernel_equals_transformers(tmp_path, monkeypatch):
    """Soft-capping inside the kernel, on local (window 8) and global layers, prompts past the window."""
    model_dir = str(build_model_dir(tmp_path / "m", "gemma2", norm_std=0.1, seed=20))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    runner = ModelRunner(model_dir, device=str(DEVICE), cuda_graphs=False)
    assert runner.ops is triton_ops and runner.spec.attn_logit_softcap is not None
    prompts = random_prompts([19, 12], vocab_size=512, seed=3)
    scheduler = TrivialScheduler(runner)
    scheduler.add("chunked", prompts[0], NEW_TOKENS + 4, prefill_chunks=[9])
    scheduler.add("late", prompts[1], NEW_TOKENS + 4, arrival_step=1)
    outputs = scheduler.run()
    assert [outputs["chunked"], outputs["late"]] == hf_greedy(model_dir, prompts, NEW_TOKENS + 4)


def test_gpt_oss_attention_sinks_and_windows_through_the_triton_kernel_equal_transformers(tmp_path, monkeypatch):
    """Each layer's sinks inside the kernel, on windowed (8) and full layers, prompts past the window
    (on a GPU the experts take the Triton fused_moe with their biases and clamped SwiGLU as well)."""
    model_dir = str(build_model_dir(tmp_path / "m", "gpt_oss", num_layers=3, intermediate_size=48, swiglu_limit=1.5,
                                    seed=4))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    runner = ModelRunner(model_dir, device=str(DEVICE), cuda_graphs=False)
    assert runner.ops is triton_ops and runner.model.layers[0].sinks is not None
    prompts = random_prompts([19, 12], vocab_size=512, seed=3)
    scheduler = TrivialScheduler(runner)
    scheduler.add("chunked", prompts[0], NEW_TOKENS + 4, prefill_chunks=[9])
    scheduler.add("late", prompts[1], NEW_TOKENS + 4, arrival_step=1)
    outputs = scheduler.run()
    assert [outputs["chunked"], outputs["late"]] == hf_greedy(model_dir, prompts, NEW_TOKENS + 4)
