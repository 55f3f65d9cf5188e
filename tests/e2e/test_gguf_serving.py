"""GGUF files through the real processes: ``pagedserve serve x.gguf`` (tokenizer from the file's
metadata, text prompts over HTTP) and the offline LLM (one rank, two tensor-parallel ranks) against
transformers loading the same file (Q4_K_M's Q4_K and Q6_K on the integer kernels, two ranks); k-quants from
llama.cpp's own quantizer; a bad file refused at start in one line, no process left behind."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from pagedserve.offline.llm import LLM, SamplingParams
from pagedserve.tools.gguf_model import build_gguf_model
from support.greedy import assert_equal_to_transformers, client, greedy_completions
from support.oracle import hf_greedy, hf_tokenizer
from support.server import Server, pagedserve_processes

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
# two ranks' halves of every projection's inputs in whole k-quant blocks of 256
K_SHAPE = dict(SHAPE, hidden_size=512, intermediate_size=1024)
PROMPT_IDS = [[5, 6, 7, 8, 9], [11, 400, 3, 77, 12, 90, 18, 240, 33], [101]]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Made model directories go to this test's own cache (the server inherits it), not the user's."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))


def test_serve_a_gguf_file_with_its_own_tokenizer_gives_transformers_greedy_text(tmp_path):
    path = build_gguf_model(tmp_path / "tiny-Q8_0.gguf", "Q8_0", "qwen2", seed=11, **SHAPE)
    tok = hf_tokenizer(str(path))  # transformers' tokenizer of the same file
    texts = ("Hello, world! The quick brown fox", "東京は大きい。 🙂 def main():")
    prompts = [tok(text).input_ids for text in texts]
    srv = Server(str(path), ["--num-gpu-blocks", "64", "--max-model-len", "256", "--dtype", "float32"]).start(tmp_path)
    try:
        assert [m.id for m in client(srv).models.list().data] == ["tiny-Q8_0.gguf"]
        assert_equal_to_transformers(str(path), prompts, greedy_completions(srv, prompts, 12), 12)
    finally:
        srv.stop()


@pytest.mark.parametrize("tensor_type, arch, tp", [("Q8_0", "llama", 2), ("Q4_0", "qwen2", 2), ("F16", "llama", 1),
                                                   ("Q4_K_M", "llama", 2)])
def test_offline_greedy_tokens_of_a_gguf_file_equal_transformers(tmp_path, tensor_type, arch, tp):
    shape = K_SHAPE if tensor_type == "Q4_K_M" else SHAPE
    path = build_gguf_model(tmp_path / f"{arch}-{tensor_type}.gguf", tensor_type, arch, seed=tp, **shape)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), num_gpu_blocks=64, max_model_len=256, tensor_parallel_size=tp, dtype="float32") as llm:
        outs = llm.generate(PROMPT_IDS, greedy, use_tqdm=False)
    for prompt, out in zip(PROMPT_IDS, outs):
        assert out.outputs[0].token_ids == hf_greedy(str(path), prompt, 12)


def test_k_quants_from_llama_quantize_run_on_the_integer_kernels_and_the_log_names_them(tmp_path, caplog):
    """Q4_K_M's Q4_K and Q6_K matrices (llama.cpp's own quantizer's blocks) run as int4 / int8 layers; tokens
    still transformers'."""
    from pagedserve.bench.llamacpp import QUANTIZE, bin_dir
    from pagedserve.deploy.serve_config import ServeConfig
    from pagedserve.worker_proc.model_runner import ModelRunner
    from support.worker_harness import TrivialScheduler

    if not (bin_dir() / QUANTIZE).exists():
        pytest.skip(f"llama.cpp's {QUANTIZE} is not built here (bench/llamacpp.py ensure_built)")
    shape = dict(SHAPE, hidden_size=256, intermediate_size=512)  # k-quants take rows of 256 inputs
    bf16 = build_gguf_model(tmp_path / "bf16.gguf", "BF16", "llama", seed=7, **shape)
    path = tmp_path / "q4_k_m.gguf"
    subprocess.run([str(bin_dir() / QUANTIZE), str(bf16), str(path), "Q4_K_M"], check=True, capture_output=True)
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        runner = ModelRunner(ServeConfig(model=str(path), device="cpu").model, dtype="float32")
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "Q4_K matrices run as integer weight-only layers, int4 in groups of 32" in logged
    assert "Q6_K matrices run as integer weight-only layers, int8 in groups of 16" in logged
    assert "no native kernel" not in logged
    scheduler = TrivialScheduler(runner, block_size=4)
    for i, prompt in enumerate(PROMPT_IDS):
        scheduler.add(f"r{i}", prompt, 12)
    outputs = scheduler.run()
    for i, prompt in enumerate(PROMPT_IDS):
        assert outputs[f"r{i}"] == hf_greedy(str(path), prompt, 12)


def test_a_truncated_gguf_is_refused_at_start_in_one_line_and_nothing_is_left_running(tmp_path):
    path = build_gguf_model(tmp_path / "m.gguf", "Q8_0", "llama", **SHAPE)
    data = path.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: len(data) // 2])
    run_parent = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "pagedserve.deploy.cli", "serve", str(short), "--port", "0",
                          "--device", "cpu", "--run-dir-parent", str(run_parent)],
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "short.gguf is not a readable GGUF file (truncated or corrupt" in out, out[-3000:]
    assert len([line for line in out.splitlines() if "short.gguf" in line]) == 1
    assert not pagedserve_processes(str(run_parent)) and not list(run_parent.glob("pagedserve-*"))


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_k_m"])
def test_a_file_written_by_llama_cpps_own_converter_and_quantizer_serves_transformers_tokens(
        gguf_type, model_factory, tmp_path):
    """Not only the gguf package's writer: llama.cpp's convert_hf_to_gguf.py (q8_0) and llama-quantize (q4_k_m,
    which puts Q5_0 where rows of 128 inputs cannot hold a k-quant's 256) through `pagedserve serve`."""
    from pagedserve.bench import llamacpp

    if not (llamacpp.bin_dir() / llamacpp.QUANTIZE).exists():
        pytest.skip(f"llama.cpp is not built under {llamacpp.home()} (bench/llamacpp.py ensure_built)")
    model = model_factory("llama", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256)
    path = llamacpp.ensure_gguf(model, gguf_type)
    srv = Server(str(path), ["--num-gpu-blocks", "64", "--max-model-len", "256", "--dtype", "float32"]).start(tmp_path)
    try:
        assert_equal_to_transformers(str(path), PROMPT_IDS, greedy_completions(srv, PROMPT_IDS, 12), 12)
    finally:
        srv.stop()
