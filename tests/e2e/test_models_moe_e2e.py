"""Mixtures of experts through the real multi-process path: the server's greedy tokens equal
transformers' (Mixtral, Qwen2-MoE with its shared expert, gpt-oss with its attention sinks, windows
and clamped SwiGLU); two tensor-parallel ranks, each with half of every expert's intermediate
features, decode transformers' tokens; a config that routes each token to more experts than it has
is refused in one line before any process starts."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.tools.demo_model import build_model_dir
from support.greedy import assert_equal_to_transformers, greedy_completions
from support.oracle import hf_tokenizer
from support.server import Server
from support.worker_harness import hf_greedy, random_prompts, run_two_ranks
from test_models_e2e import assert_refused_in_one_line_with_nothing_started, refused_serve
from test_worker_tensor_parallel import NEW_TOKENS, RANK_SCRIPT

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "512", "--max-num-batched-tokens", "256"]
PROMPTS = [
    "Hello, world! " * 3,
    "The quick brown fox jumps over the lazy dog. A paged attention engine keeps its cache in blocks.",
]
MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2)
QWEN2_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)
# layers 0 and 2 slide a window of 8 (shorter than every prompt here), layer 1 sees all; 4 experts, top 2
GPT_OSS = dict(num_layers=3, intermediate_size=48, swiglu_limit=1.5, seed=4)


@pytest.mark.parametrize("arch, overrides, experts", [("mixtral", MIXTRAL, 8), ("qwen2_moe", QWEN2_MOE, 8),
                                                      ("gpt_oss", GPT_OSS, 4)])
def test_a_mixture_of_experts_serves_transformers_greedy_tokens(arch, overrides, experts, model_factory, tmp_path):
    model = model_factory(arch, **overrides)
    tok = hf_tokenizer(model)
    prompts = [tok(p).input_ids for p in PROMPTS]
    assert min(len(p) for p in prompts) > 8
    srv = Server(model, SERVER_ARGS).start(tmp_path)
    try:
        assert_equal_to_transformers(model, prompts, greedy_completions(srv, prompts, 16), 16)
        # the worker log names how the experts run (here: grouped by expert, in the dense layers' CPU layout)
        log = srv.log_path.read_text()
        assert f"mixture of experts: {experts} experts, top 2; grouped by expert: " in log
        assert "model implementation: native (" in log  # --model-impl auto takes the family file
    finally:
        srv.stop()


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_two_tensor_parallel_ranks_split_every_expert_and_produce_transformers_greedy_tokens(arch, tmp_path):
    """Each rank: half of every expert's intermediate features (gpt-oss: down's bias on rank 0 only),
    half the heads (gpt-oss: their sinks)."""
    if arch == "qwen2_moe":
        moe = build_model_dir(tmp_path / "moe", "qwen2_moe", num_heads=4, num_kv_heads=2, num_layers=3,
                              mlp_only_layers=[1], seed=2, **QWEN2_MOE)
    else:
        moe = build_model_dir(tmp_path / "moe", "gpt_oss", num_heads=4, num_kv_heads=2, **GPT_OSS)
    prompts = random_prompts([7, 15, 4], vocab_size=512, seed=8)
    rank0 = run_two_ranks(RANK_SCRIPT, tmp_path, [json.dumps(prompts), str(moe)], timeout=120)
    *tokens, heads = rank0[0]
    assert heads == [1, 2]
    for ours, theirs in zip(tokens, hf_greedy(moe, prompts, NEW_TOKENS)):
        assert ours[: len(theirs)] == theirs and len(theirs) >= 10


def test_more_experts_per_token_than_experts_is_refused_before_any_process_starts_in_one_line(model_factory, tmp_path):
    model = tmp_path / "broken"
    shutil.copytree(model_factory("mixtral", **MIXTRAL), model)
    config = json.loads((model / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (model / "config.json").write_text(json.dumps(config))
    line = assert_refused_in_one_line_with_nothing_started(refused_serve(model, tmp_path), tmp_path)
    assert line.endswith("num_experts_per_tok=9 needs between 1 and num_local_experts=8 experts to pick from"), line
