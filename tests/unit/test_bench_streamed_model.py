"""bench/streamed_model.py: a model written layer by layer loads as a hub checkpoint everywhere; greedy tokens
from ModelRunner equal transformers' generate(do_sample=False) on it (float32, CPU)."""

from __future__ import annotations

import json

import safetensors
from transformers import AutoModelForCausalLM

from pagedserve.bench.shapes import SHAPES
from pagedserve.bench.streamed_model import build_streamed_model_dir
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import random_prompts
from test_model_parity_moe import PROMPT_LENGTHS, run
from test_model_parity import assert_equal_to_oracle

# the issue-52 shape's dimensions, scaled down; its initializer too (Qwen3's, a bench shape's)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, vocab_size=512, seed=5,
            dtype="float32", initializer_range=0.2)


def test_a_streamed_qwen3_moe_loads_in_transformers_with_every_tensor_and_gives_its_greedy_tokens(tmp_path):
    model_dir = build_streamed_model_dir(tmp_path / "m", **TINY)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == TINY["num_layers"] + 2  # embeddings, a shard per layer, the final norm and lm_head
    for shard in shards:
        with safetensors.safe_open(str(model_dir / shard), "pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == shard} == set(f.keys())
    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # what llama.cpp's converter picks its class by, and the hub's spelling of the expert count
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == TINY["num_experts"]
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=512, seed=8)
    assert_equal_to_oracle(model_dir, run(ModelRunner(str(model_dir)), prompts), prompts)


def test_the_moe_bench_shape_is_written_layer_by_layer_in_bfloat16():
    shape = SHAPES["qwen3-moe-a3b-12l"]
    assert shape.streamed and shape.model["dtype"] == "bfloat16"
    assert (shape.num_prompts, shape.input_len, shape.output_len) == (64, (16, 64), 256)
