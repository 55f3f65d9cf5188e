"""DeepSeek-V2 / V3 (multi-head latent attention over a latent cache, grouped top-k experts) through the
real multi-process path: the server's greedy tokens equal transformers' with prefix caching and
chunked prefill; the offline LLM's on a cache tight enough to preempt by swap and by recompute; two
tensor-parallel ranks, each with half of the heads and the whole latent cache; a config that routes
each token to more experts than it has is refused in one line before any process starts."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.offline.llm import LLM, SamplingParams
from pagedserve.tools.demo_model import build_model_dir
from support.greedy import assert_equal_to_transformers
from support.oracle import hf_greedy
from support.server import Server
from support.worker_harness import hf_greedy as hf_greedy_batch, random_prompts, run_two_ranks
from test_models_e2e import (assert_refused_in_one_line_with_nothing_started, refused_serve,
                             serve_prompts_sharing_a_prefix)
from test_worker_tensor_parallel import NEW_TOKENS, RANK_SCRIPT

pytestmark = pytest.mark.slow

HEADS = dict(num_heads=4, num_kv_heads=4)  # transformers' MLA repeats no KV heads: the two counts agree
MODELS = {"deepseek_v2": dict(num_layers=3, seed=11, **HEADS), "deepseek_v3": dict(num_layers=3, seed=3, **HEADS)}


@pytest.mark.parametrize("arch", list(MODELS))
def test_deepseek_serves_transformers_greedy_tokens_with_prefix_caching_and_chunked_prefill(arch, model_factory,
                                                                                            tmp_path):
    """Prompts in 8-token steps over blocks of 4, the later two finding their first 20 tokens'
    latent rows cached."""
    model = model_factory(arch, **MODELS[arch])
    srv, prompts, answers = serve_prompts_sharing_a_prefix(model, tmp_path)
    try:
        assert_equal_to_transformers(model, prompts, answers, 16)
        log = srv.log()
        assert "multi-head latent attention: the cache keeps one latent row of 32 a token and layer" in log
        assert "mixture of experts: 8 experts, top 2; grouped by expert: " in log
    finally:
        srv.stop()


SHARED = [(11 * i + 5) % 400 + 3 for i in range(24)]  # three full blocks of 8
PROMPTS = [SHARED + [7, 8, 9], SHARED + [40, 41], [5, 6, 7, 8, 9, 10, 11], list(range(50, 90)), [300, 301, 302]]
MAX_TOKENS = 20


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_deepseek_gives_transformers_greedy_tokens_through_preemption_by_swap_and_recompute(mode, model_factory):
    """16 blocks of 8 tokens for 5 sequences of up to 60 tokens (24 blocks at their longest, all admitted at
    once): sequences are preempted and resumed from swapped-in or recomputed latent rows. Each way has its own
    run, as ``--preemption-mode`` sets it: under ``auto`` which way a victim leaves depends on its length when
    memory runs out, and that on how the requests' arrivals fell into steps."""
    model = model_factory("deepseek_v3", **MODELS["deepseek_v3"])
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # a block: 3 layers x 8 tokens x 32 float32 = 3 KiB, so 0.0001 GiB of swap holds 34 of them
    with LLM(model, num_gpu_blocks=16, block_size=8, swap_space=0.0001, preemption_mode=mode, max_num_seqs=8,
             max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=True, debug_invariants=True,
             num_threads=1) as llm:
        llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # the prefix cache holds SHARED's latent rows
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        stats = llm.refresh_stats()[0]
    assert [o.outputs[0].token_ids for o in outs] == [e[:MAX_TOKENS] for e in expected]
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("arch", list(MODELS))
def test_two_tensor_parallel_ranks_split_the_heads_keep_the_whole_latent_and_give_transformers_tokens(arch,
                                                                                                     tmp_path):
    """Each rank: 2 of the 4 heads (q, kv_b_proj's W_UK and W_UV, o_proj's columns), half of every expert
    and of the shared and dense MLPs, and the whole latent cache (one 'KV head')."""
    model = build_model_dir(tmp_path / "m", arch, **MODELS[arch])
    prompts = random_prompts([7, 15, 4], vocab_size=512, seed=8)
    rank0 = run_two_ranks(RANK_SCRIPT, tmp_path, [json.dumps(prompts), str(model)], timeout=180)
    *tokens, heads = rank0[0]
    assert heads == [1, 2]
    for ours, theirs in zip(tokens, hf_greedy_batch(model, prompts, NEW_TOKENS)):
        assert ours[: len(theirs)] == theirs and len(theirs) >= 10


def test_more_experts_per_token_than_routed_experts_is_refused_before_any_process_starts(model_factory, tmp_path):
    model = tmp_path / "broken"
    shutil.copytree(model_factory("deepseek_v3", **MODELS["deepseek_v3"]), model)
    config = json.loads((model / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (model / "config.json").write_text(json.dumps(config))
    line = assert_refused_in_one_line_with_nothing_started(refused_serve(model, tmp_path), tmp_path)
    assert line.endswith("num_experts_per_tok=9 needs between 1 and n_routed_experts=8 experts to pick from"), line


def test_a_deepseek_trace_replays_exactly_both_ways(model_factory, tmp_path):
    """Recorded through the server (prefix caching, chunks, a sampled request beside greedy ones): fresh
    workers return every recorded step's tokens bit for bit, and the scheduler alone rebuilds every step."""
    from pathlib import Path

    import httpx

    from pagedserve.protocol.trace import read_trace
    from pagedserve.scheduler_proc.replay import replay_scheduler
    from pagedserve.tools.replay import replay_workers

    model = model_factory("deepseek_v2", **MODELS["deepseek_v2"])
    path = tmp_path / "mla.trace"
    srv = Server(model, ["--num-gpu-blocks", "64", "--num-threads", "1", "--block-size", "4",
                         "--max-num-batched-tokens", "8", "--max-num-seqs", "4",
                         "--enable-prefix-caching", "--enable-chunked-prefill", "--record-trace", str(path)]).start(tmp_path)
    try:
        for prompt, temperature in (("Hello, world! Hello, world!", 0.0), ("Hello, world! The lazy dog.", 0.8)):
            body = {"model": Path(model).name, "prompt": prompt, "max_tokens": 8, "temperature": temperature,
                    "seed": 5, "ignore_eos": True}
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
    finally:
        srv.stop()
    assert read_trace(str(path)).meta["model_id"].startswith("DeepseekV2ForCausalLM:")
    report = replay_scheduler(str(path))
    assert report.ok, report.mismatch
    steps, tokens = replay_workers(str(path), model, "cpu", num_threads=1)
    assert steps == report.steps and tokens >= 16
