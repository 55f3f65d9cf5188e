"""llama.cpp as a bench peer: where ``llama-server`` has been built (``bench/llamacpp.py``; the
build takes minutes, so the suite never starts one), the same token-id workload served by
pagedserve and by llama.cpp on the same weights, converted by llama.cpp's own converter."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedserve.bench import llamacpp
from pagedserve.bench.cli import bench_main

BUILT = (llamacpp.bin_dir() / llamacpp.SERVER).exists() and (llamacpp.bin_dir() / llamacpp.QUANTIZE).exists()

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not BUILT, reason=f"llama-server is not built under {llamacpp.home()} (set {llamacpp.LLAMACPP_DIR_ENV}); "
                      "python -c 'from pagedserve.bench import llamacpp; llamacpp.ensure_built()' builds it")]


@pytest.mark.parametrize("gguf_type", ["f32", "q4_k_m"])
def test_llamacpp_and_pagedserve_each_generate_every_requested_token_at_one_and_two_streams(
        gguf_type, model_factory, tmp_path):
    model = model_factory("llama", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256)
    out = tmp_path / "peer.json"
    rc = bench_main(argparse.Namespace(bench_args=[
        "peer", "--model", str(model), "--engines", "pagedserve,llamacpp", "--llamacpp-type", gguf_type,
        "--num-prompts", "4", "--input-len", "8", "24", "--output-len", "8", "--max-concurrency", "1,2",
        "--runs", "1", "--warmup-prompts", "1", "--dtype", "float32", "--output-json", str(out)]))
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert sorted(runs) == ["llamacpp@1", "llamacpp@2", "pagedserve@1", "pagedserve@2"]
    for name, rs in runs.items():
        assert rs[0]["failed"] == 0 and rs[0]["output_token_throughput"] > 0, (name, rs[0]["errors"])
    assert (llamacpp.gguf_dir(Path(model)) / f"{gguf_type}.gguf").exists()
