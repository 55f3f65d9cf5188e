"""More model families through the real server (greedy tokens equal transformers'), and a
model the workers cannot run refused at startup with a message naming the ones they can."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from support.oracle import hf_tokenizer
from support.greedy import assert_equal_to_transformers, greedy_completions
from support.server import Server

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "512", "--max-num-batched-tokens", "256"]
PROMPTS = [
    "Hello, world! " * 3,
    "The quick brown fox jumps over the lazy dog. A paged attention engine keeps its cache in blocks, "
    "and a sliding window only looks back so far.",
]


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3", {}),  # RMSNorm on q and k per head
    ("mistral", {"sliding_window": 8}),  # every prompt here is longer than the window
])
def test_model_family_serves_transformers_greedy_tokens(arch, overrides, model_factory, tmp_path):
    model = model_factory(arch, **overrides)
    tok = hf_tokenizer(model)
    prompts = [tok(p).input_ids for p in PROMPTS]
    if "sliding_window" in overrides:
        assert min(len(p) for p in prompts) > overrides["sliding_window"]
    srv = Server(model, SERVER_ARGS).start(tmp_path)
    try:
        assert_equal_to_transformers(model, prompts, greedy_completions(srv, prompts, 16), 16)
    finally:
        srv.stop()


def test_an_unsupported_architecture_is_refused_at_startup_naming_the_supported_ones(model_factory, tmp_path):
    from transformers import GPT2Config

    model = tmp_path / "gpt2"
    shutil.copytree(model_factory("qwen2"), model)  # keeps the tokenizer: only the network is foreign
    (model / "config.json").unlink()
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, architectures=["GPT2LMHeadModel"]).save_pretrained(model)
    assert json.loads((model / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(model), "--port", "0",
                          "--run-dir-parent", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    out = run.stdout + run.stderr
    assert "Traceback" not in out, out[-3000:]
    assert "GPT2LMHeadModel" in out and "is not supported" in out, out[-3000:]
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in out, out[-3000:]
    assert not list(tmp_path.glob("pagedserve-*"))  # the run dir was cleaned up
