"""More model families through the real server (greedy tokens equal transformers'), natively and by
the transformers backend; a model no implementation can run, or whose config contradicts itself,
refused by ``pagedserve serve`` before any process starts, in one line (naming the architectures
it runs natively)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pagedserve.protocol.model_architectures import ARCHITECTURES
from support.greedy import assert_equal_to_transformers, greedy_completions
from support.oracle import hf_tokenizer
from support.server import Server, pagedserve_processes, wait_until

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


def prompt_ids_sharing_a_prefix(model: str) -> list[list[int]]:
    """Three prompts of 30-40 tokens, the last two opening with the first one's first 20."""
    tok = hf_tokenizer(model)
    head = tok(PROMPTS[1]).input_ids
    assert len(head) >= 30
    return [head[:36], head[:20] + tok(" Hello, world! The lazy dog.").input_ids, head[:20] + head[24:40]]


def serve_prompts_sharing_a_prefix(model: str, tmp_path: Path) -> tuple[Server, list[list[int]], list]:
    """A server taking 8-token steps (chunked prefill) over blocks of 4 with prefix caching, and its greedy
    answers to ``prompt_ids_sharing_a_prefix``: the first alone, then the rest, which find its first 20
    tokens cached (checked here). The caller stops the server, after any checks of its log."""
    prompts = prompt_ids_sharing_a_prefix(model)
    srv = Server(model, ["--num-gpu-blocks", "128", "--max-model-len", "256", "--max-num-batched-tokens", "8",
                         "--max-num-seqs", "4", "--block-size", "4", "--enable-prefix-caching",
                         "--enable-chunked-prefill"]).start(tmp_path)
    try:
        first = greedy_completions(srv, prompts[:1], 16)
        rest = greedy_completions(srv, prompts[1:], 16)
        # the counters reach /metrics with the next stats heartbeat (every 0.5 s)
        assert wait_until(lambda: prefix_cache_hits(srv) >= 2 * 20, 5)
    except BaseException:
        srv.stop()
        raise
    return srv, prompts, first + rest


def prefix_cache_hits(srv: Server) -> float:
    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("pagedserve_prefix_cache_hits_total"))


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "gpt_oss"])
def test_family_serves_transformers_greedy_tokens_with_prefix_caching_and_chunked_prefill(arch, model_factory,
                                                                                           tmp_path):
    """Prompts of 8-token steps (chunked prefill) over blocks of 4, the later ones finding their first
    20 tokens cached. Gemma 2's window (8) is shorter than every prompt: its local layers attend
    over a window while its global layers see everything, with soft-capped scores and logits. gpt-oss
    alternates windows of 8 and full layers alike, each with its attention sinks (native kernels)."""
    model = model_factory(arch, norm_std=0.1, seed=20)
    srv, prompts, answers = serve_prompts_sharing_a_prefix(model, tmp_path)
    try:
        if arch == "gemma2":
            assert "attention soft-capping runs the torch reference attention on CPU" in srv.log()
            # its global layers read every block, its local layers' KV group frees blocks behind their window
            assert ("1 of 2 layers attend within 8 positions: their 1 KV group(s) free blocks behind the window, "
                    "the global group of 1 layers keeps every block") in srv.log()
        assert_equal_to_transformers(model, prompts, answers, 16)
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


def refused_serve(model, tmp_path, *args: str) -> subprocess.CompletedProcess:
    run_dirs = tmp_path / "run"
    run_dirs.mkdir()
    return subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(model), "--port", "0",
                           "--run-dir-parent", str(run_dirs), *args], capture_output=True, text=True, timeout=120)


def assert_refused_in_one_line_with_nothing_started(run: subprocess.CompletedProcess, tmp_path) -> str:
    assert run.returncode == 2, run.stderr[-3000:]
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve serve: "), lines[-20:]
    assert not list((tmp_path / "run").iterdir())  # no run dir: no process was ever started
    assert not pagedserve_processes(str(tmp_path / "run"))
    return lines[0]


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


def test_an_architecture_outside_the_native_families_is_refused_by_native_before_any_process_starts(
        model_factory, tmp_path):
    from transformers import GPT2Config

    model = tmp_path / "gpt2"
    shutil.copytree(model_factory("qwen2"), model)  # keeps the tokenizer: only the network is foreign
    (model / "config.json").unlink()
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, architectures=["GPT2LMHeadModel"]).save_pretrained(model)
    assert json.loads((model / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    line = assert_refused_in_one_line_with_nothing_started(
        refused_serve(model, tmp_path, "--model-impl", "native"), tmp_path)
    assert "GPT2LMHeadModel" in line and "is not supported" in line
    for supported in ARCHITECTURES:
        assert supported in line


def test_a_model_whose_config_contradicts_itself_is_refused_in_one_line_before_any_process_starts(
        model_factory, tmp_path):
    model = tmp_path / "broken"
    shutil.copytree(model_factory("gemma2"), model)
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * (config["num_hidden_layers"] + 1)
    (model / "config.json").write_text(json.dumps(config))
    line = assert_refused_in_one_line_with_nothing_started(refused_serve(model, tmp_path), tmp_path)
    assert "layer_types" in line and "num_hidden_layers" in line


def test_an_architecture_transformers_does_not_know_either_is_refused_before_any_process_starts(
        model_factory, tmp_path):
    model = tmp_path / "unknown"
    shutil.copytree(model_factory("qwen2"), model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    line = assert_refused_in_one_line_with_nothing_started(refused_serve(model, tmp_path), tmp_path)
    assert "NoSuchModelForCausalLM" in line and "transformers backend" in line and "LlamaForCausalLM" in line
