"""``--enable-expert-parallel``: each of two tensor-parallel ranks holds half of the experts whole, and
greedy tokens in float32 still equal transformers' ``generate(do_sample=False)``: Qwen3-MoE, Mixtral,
gpt-oss (its biased experts), Qwen2-MoE (its shared expert), DeepSeek-V3 (grouped routing, shared
experts) with either combine (the layer's all-reduce, or the all-to-all exchange of
``PAGEDSERVE_EP_ALL_TO_ALL=1``); served over HTTP (TP=2, and TP=1 where the one rank holds every expert)
and through the offline LLM with prefix caching, chunked prefill and preemption; the worker log names
each rank's experts. The flag on a dense model, a tensor-parallel size that does not divide the experts,
or LoRA with experts placed across ranks is refused in one line before any process starts."""

from __future__ import annotations

import json

import pytest

from pagedserve.offline.llm import LLM, SamplingParams
from pagedserve.tools.demo_model import build_model_dir
from support.greedy import assert_equal_to_transformers, greedy_completions
from support.oracle import hf_tokenizer
from support.server import Server
from support.worker_harness import hf_greedy, random_prompts, run_two_ranks
from test_models_e2e import assert_refused_in_one_line_with_nothing_started, refused_serve

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
MODELS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, seed=5),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, seed=7),
    "gpt_oss": dict(num_layers=3, intermediate_size=48, swiglu_limit=1.5, seed=4),  # biased experts
    # a shared expert (still sliced across the ranks), a dense layer between sparse ones
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, num_layers=3, mlp_only_layers=[1], seed=2),
    # grouped top-k routing, shared experts (sliced as before), a dense first layer; MLA's KV heads are its heads
    "deepseek_v3": dict(num_layers=3, seed=3, num_heads=4, num_kv_heads=4),
}
EXPERTS = {"qwen3_moe": 8, "mixtral": 4, "gpt_oss": 4, "qwen2_moe": 8, "deepseek_v3": 8}

# Runs in each rank's process. Arguments: tests dir, rank, port, prompts (JSON), model dirs...
# Each model runs with each combine: the all-reduce (default), then the all-to-all exchange.
RANK_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from pagedserve.worker_proc.model_runner import ModelRunner
from support.worker_harness import TrivialScheduler

tests_dir, rank, port, prompts, model_dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5:]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

def share_tokens(result, expected_req_ids):
    tokens = torch.tensor(result.sampled_token_ids if rank == 0 else [0] * len(expected_req_ids))
    dist.broadcast(tokens, src=0)
    return tokens.tolist()

outputs = []
for model_dir in model_dirs:
    for all_to_all in ("0", "1"):
        os.environ["PAGEDSERVE_EP_ALL_TO_ALL"] = all_to_all
        runner = ModelRunner(model_dir, tp_rank=rank, tp_size=2, expert_parallel=True)
        block = next(layer.moe for layer in runner.model.layers if layer.moe is not None)
        scheduler = TrivialScheduler(runner, share_tokens=share_tokens)
        scheduler.add("a", prompts[0], NEW_TOKENS)
        scheduler.add("b", prompts[1], NEW_TOKENS, prefill_chunks=[6], arrival_step=1)
        scheduler.add("c", prompts[2], NEW_TOKENS, arrival_step=3)
        result = scheduler.run()
        placed = [block.placement.count, block.placement.all_to_all]
        outputs.append([result["a"], result["b"], result["c"], placed])
print(json.dumps(outputs), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # torch + gloo may abort in static destructors at exit
""".replace("NEW_TOKENS", str(NEW_TOKENS))


def test_two_ranks_each_holding_half_the_experts_whole_give_transformers_tokens_with_either_combine(tmp_path):
    models = [build_model_dir(tmp_path / arch, arch, **MODELS[arch]) for arch in MODELS]
    prompts = random_prompts([7, 15, 4], vocab_size=512, seed=8)
    rank0 = run_two_ranks(RANK_SCRIPT, tmp_path, [json.dumps(prompts), *map(str, models)], timeout=300)
    for i, (arch, model) in enumerate(zip(MODELS, models)):
        expected = hf_greedy(model, prompts, NEW_TOKENS)
        for all_to_all, (*tokens, placed) in zip((False, True), rank0[2 * i: 2 * i + 2]):
            assert placed == [EXPERTS[arch] // 2, all_to_all]
            for ours, theirs in zip(tokens, expected):
                assert ours[: len(theirs)] == theirs and len(theirs) >= 10, (model, all_to_all)


SERVER_ARGS = ["--enable-prefix-caching", "--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
               "--max-model-len", "256", "--dtype", "float32", "--enable-expert-parallel"]
PROMPTS = [
    "Hello, world! " * 3,
    "The quick brown fox jumps over the lazy dog. A paged attention engine keeps its cache in blocks.",
]


@pytest.mark.parametrize("arch, tp", [("qwen3_moe", 2), ("mixtral", 2), ("gpt_oss", 2), ("qwen3_moe", 1)])
def test_a_server_placing_whole_experts_on_its_ranks_answers_transformers_greedy_tokens(arch, tp, model_factory,
                                                                                        tmp_path):
    """Prompts longer than the step's 16 tokens are chunked; the shared prefix is served from the cache.
    At TP=1 the one rank holds every expert (the plain path, as vLLM's flag is there)."""
    model = model_factory(arch, **MODELS[arch])
    tok = hf_tokenizer(model)
    prompts = [tok(p).input_ids for p in PROMPTS]
    prompts.append(prompts[1][:20] + prompts[0])  # shares the second prompt's first blocks
    srv = Server(model, [*SERVER_ARGS, "-tp", str(tp)]).start(tmp_path)
    try:
        assert_equal_to_transformers(model, prompts[:2], greedy_completions(srv, prompts[:2], 16), 16)
        assert_equal_to_transformers(model, prompts[2:], greedy_completions(srv, prompts[2:], 16), 16)
        log = srv.log_path.read_text()
        half = EXPERTS[arch] // 2
        if tp == 1:
            assert "expert parallel: one rank holds every expert" in log
            return
        assert f"expert parallel: rank 0 of 2 holds experts 0-{half - 1} of {2 * half} whole; all-reduce combine" in log
        assert f"expert parallel: rank 1 of 2 holds experts {half}-{2 * half - 1} of {2 * half} whole" in log
    finally:
        srv.stop()


def test_the_offline_llm_with_placed_experts_gives_transformers_tokens_through_preemption(model_factory):
    """12 blocks of 4 tokens for 4 sequences of up to ~45 tokens: sequences are preempted and resumed."""
    model = model_factory("qwen3_moe", **MODELS["qwen3_moe"])
    prompts = random_prompts([20, 9, 17, 13], vocab_size=512, seed=3)
    prompts[2] = prompts[0][:12] + prompts[2][12:]  # a cached prefix
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(model, tensor_parallel_size=2, enable_expert_parallel=True, num_gpu_blocks=24, block_size=4,
             max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, enable_prefix_caching=True,
             dtype="float32", num_threads=1) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        stats = llm.refresh_stats()[0]
    for out, theirs in zip(outs, hf_greedy(model, prompts, 24)):
        assert list(out.outputs[0].token_ids[: len(theirs)]) == theirs and len(theirs) >= 10
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hits > 0


def test_expert_parallel_on_a_dense_model_is_refused_before_any_process_starts_in_one_line(model_factory, tmp_path):
    run = refused_serve(model_factory("qwen2"), tmp_path, "--enable-expert-parallel")
    line = assert_refused_in_one_line_with_nothing_started(run, tmp_path)
    assert line.endswith("--enable-expert-parallel: Qwen2ForCausalLM has no mixture of experts to place"), line


def test_a_tensor_parallel_size_that_does_not_divide_the_experts_is_refused_before_any_process_starts(model_factory,
                                                                                                      tmp_path):
    model = model_factory("mixtral", num_local_experts=3, num_experts_per_tok=2)
    run = refused_serve(model, tmp_path, "--enable-expert-parallel", "-tp", "2")
    line = assert_refused_in_one_line_with_nothing_started(run, tmp_path)
    assert line.endswith("--enable-expert-parallel: tensor-parallel size 2 does not divide the 3 experts "
                         "(num_local_experts); pick a tp_size that does"), line


def test_expert_adapters_with_experts_placed_across_ranks_are_refused_before_any_process_starts(model_factory,
                                                                                               tmp_path):
    run = refused_serve(model_factory("qwen3_moe", **MODELS["qwen3_moe"]), tmp_path, "--enable-expert-parallel",
                        "-tp", "2", "--enable-lora")
    line = assert_refused_in_one_line_with_nothing_started(run, tmp_path)
    assert line.endswith("--enable-lora does not run with --enable-expert-parallel at --tensor-parallel-size > 1"), line
