"""GPTQ and AWQ checkpoints through the real processes: the offline LLM (scheduler + workers over ZeroMQ,
one rank and two tensor-parallel ranks) against transformers on the dequantized float32 model, and
checkpoints the engine cannot serve refused at start in one line, no process left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.offline.llm import LLM, SamplingParams
from pagedserve.tools.gptq_awq_model import build_gptq_awq_model_dir
from support.gptq_awq_reference import dequantized_model_dir
from support.oracle import hf_greedy

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9], [11, 400, 3, 77, 12, 90, 18, 240, 33], [101]]
CHECKPOINTS = {  # build_gptq_awq_model_dir's arguments, tensor-parallel size
    "gptq_w4_g32_asym_desc_act": (dict(method="gptq", group_size=32, sym=False, desc_act=True), 1),
    "gptq_w4_g128": (dict(method="gptq"), 2),
    "gptq_v2_w8_g64_asym": (dict(method="gptq", bits=8, group_size=64, sym=False, checkpoint_format="gptq_v2"), 2),
    "awq_w4_g64": (dict(method="awq", group_size=64), 2),
    "gptq_w4_per_channel_asym": (dict(method="gptq", group_size=None, sym=False), 2),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_offline_greedy_tokens_of_a_gptq_or_awq_checkpoint_equal_transformers(tmp_path, case):
    kwargs, tp = CHECKPOINTS[case]
    # hidden 256, intermediate 512: o_proj's and down_proj's inputs split into whole groups of 128
    model = build_gptq_awq_model_dir(tmp_path / case, arch="qwen2", hidden_size=256, intermediate_size=512,
                                     num_heads=4, num_kv_heads=2, seed=3, **kwargs)
    oracle = dequantized_model_dir(model, tmp_path / "oracle")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(model), num_gpu_blocks=64, max_model_len=256, tensor_parallel_size=tp,
             quantization=kwargs["method"]) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(str(oracle), prompt, 12)


def _serve(model, tmp_path, *flags):
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(model), "--port", "0",
                          "--device", "cpu", "--run-dir-parent", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert not list(tmp_path.glob("pagedserve-*"))  # the run dir, and with it every process, is gone
    return out


def test_a_config_the_engine_cannot_serve_is_refused_before_any_process_starts(tmp_path):
    model = build_gptq_awq_model_dir(tmp_path / "m", "awq", arch="llama")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (model / "config.json").write_text(json.dumps(config))
    assert "AWQ version 'gemv' is not supported (gemm: AutoAWQ's GEMM packing)" in _serve(model, tmp_path)


def test_a_checkpoint_the_workers_cannot_load_is_refused_at_start_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_gptq_awq_model_dir(tmp_path / "m", "gptq", arch="llama", group_size=32)
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.qzeros"
    tensors[name] = tensors[name][:, :8].contiguous()  # zero points for 64 of 128 outputs
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = _serve(model, tmp_path, "--quantization", "gptq")
    assert "o_proj.qzeros has shape [4, 8], not [4, 16]" in out, out[-3000:]
