"""A quantized checkpoint through the real processes: the offline LLM (scheduler + workers over
ZeroMQ, one rank and two tensor-parallel ranks) against transformers on the same file, and a
checkpoint the workers cannot load refused at start in one line, no process left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.oracle import hf_greedy
from pagedserve.offline.llm import LLM, SamplingParams

pytest.importorskip("compressed_tensors")
from pagedserve.tools.quantized_model import build_quantized_model_dir  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], [11, 400, 3, 77, 12, 90, 18, 240, 33], [101]]


@pytest.mark.parametrize("scheme, tp, quantized_lm_head", [("w4a16", 1, False), ("w4a16", 2, False),
                                                           ("w8a16", 2, False), ("w4a16", 1, True), ("w4a16", 2, True)])
def test_offline_greedy_tokens_of_a_quantized_checkpoint_equal_transformers(tmp_path, scheme, tp, quantized_lm_head):
    # hidden 256, intermediate 512: o_proj's and down_proj's inputs split into whole groups of 128
    # (int4), whole int32 words (int8 per channel); lm_head, quantized or not, is whole on every rank
    model = build_quantized_model_dir(tmp_path / scheme, scheme, "qwen2", quantize_lm_head=quantized_lm_head,
                                      hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, seed=3)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(model), num_gpu_blocks=64, max_model_len=256, tensor_parallel_size=tp,
             quantization="compressed-tensors") as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(str(model), prompt, 12)


def test_a_checkpoint_the_workers_cannot_load_is_refused_at_start_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_quantized_model_dir(tmp_path / "m", "w4a16", "llama")
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    tensors[name] = tensors[name].repeat(1, 3)  # three groups' scales for one group of inputs
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(model), "--port", "0",
                          "--device", "cpu", "--run-dir-parent", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "o_proj.weight_scale has shape [128, 3], not [128, 1]" in out, out[-3000:]
    assert not list(tmp_path.glob("pagedserve-*"))  # the run dir, and with it every process, is gone
