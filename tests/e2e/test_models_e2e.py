"""More model families through the real server (greedy tokens equal transformers'), natively and by
the transformers backend, and a model the workers cannot run refused at startup in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("arch", ["starcoder2", "glm4"])
def test_a_family_without_a_native_file_serves_transformers_greedy_tokens_with_prefix_caching_and_chunks(
        arch, model_factory, tmp_path):
    """The transformers backend behind the real processes: prompts share a cached prefix, are prefilled
    in chunks of 16 tokens and decode beside each other's chunks; the worker's log names the backend."""
    model = model_factory(arch)
    tok = hf_tokenizer(model)
    shared = tok(PROMPTS[1]).input_ids
    prompts = [shared + tok(tail).input_ids for tail in (" one", " two three", " four five six seven")]
    srv = Server(model, ["--num-gpu-blocks", "64", "--max-model-len", "512", "--max-num-batched-tokens", "16",
                         "--max-num-seqs", "4", "--enable-prefix-caching", "--block-size", "4"]).start(tmp_path)
    try:
        first = greedy_completions(srv, prompts[:1], 16)  # its blocks are cached before the others arrive
        assert_equal_to_transformers(model, prompts, first + greedy_completions(srv, prompts[1:], 16), 16)
        architecture = json.loads((Path(model) / "config.json").read_text())["architectures"][0]
        assert f"model implementation: transformers backend ({architecture})" in srv.log_path.read_text()
    finally:
        srv.stop()


def test_an_architecture_neither_implementation_runs_is_refused_at_startup_in_one_line(model_factory, tmp_path):
    from transformers import MambaConfig

    model = tmp_path / "mamba"
    shutil.copytree(model_factory("qwen2"), model)
    (model / "config.json").unlink()
    MambaConfig(num_hidden_layers=1, hidden_size=32, vocab_size=512, architectures=["MambaForCausalLM"]).save_pretrained(model)
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(model), "--port", "0",
                          "--run-dir-parent", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    out = run.stdout + run.stderr
    assert "Traceback" not in out, out[-3000:]
    assert "MambaForCausalLM" in out and "natively:" in out and "by the transformers backend:" in out, out[-3000:]


def test_an_unsupported_architecture_is_refused_at_startup_naming_the_supported_ones(model_factory, tmp_path):
    from transformers import GPT2Config

    model = tmp_path / "gpt2"
    shutil.copytree(model_factory("qwen2"), model)  # keeps the tokenizer: only the network is foreign
    (model / "config.json").unlink()
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, architectures=["GPT2LMHeadModel"]).save_pretrained(model)
    assert json.loads((model / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(model), "--port", "0",
                          "--run-dir-parent", str(tmp_path), "--model-impl", "native"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    out = run.stdout + run.stderr
    assert "Traceback" not in out, out[-3000:]
    assert "GPT2LMHeadModel" in out and "is not supported" in out, out[-3000:]
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in out, out[-3000:]
    assert not list(tmp_path.glob("pagedserve-*"))  # the run dir was cleaned up
