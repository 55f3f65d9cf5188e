"""``pagedserve bench offline``: the offline LLM against transformers' generate_batch, one run.

Both engines get the same random prompts (token ids, lengths uniform in a range) and
generate exactly ``--output-len`` tokens each (EOS ignored), greedy, float32. pagedserve
runs first and its processes are stopped before transformers starts, so the two never
share the CPU. Throughput is generated tokens over wall time from submit to last result.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Optional


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", default="sdpa", help="transformers attn_implementation for generate_batch "
                   "(sdpa = its paged sdpa path; 'none' skips the peer)")
    p.add_argument("--num-threads", type=int, help="torch threads for both engines")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-gpu-blocks", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="pagedserve's overlapped scheduling (default on)")
    p.add_argument("--no-check", action="store_true", help="skip comparing the two engines' tokens")
    p.add_argument("--output-json", help="write the result here")


def make_prompts(num: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    high = max(vocab - 1, 10)
    return [[rng.randrange(3, high) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def run_pagedserve(ns: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from pagedserve.deploy.offline import LLM, SamplingParams

    opts = dict(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                device=ns.device, num_threads=ns.num_threads,
                async_scheduling=ns.async_scheduling)
    if ns.num_gpu_blocks:
        opts["num_gpu_blocks"] = ns.num_gpu_blocks
    sampling = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    with LLM(ns.model, **opts) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm up
        before = llm.refresh_stats()[0]
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
        stats = llm.refresh_stats()[0]
    idle = stats.worker_idle_time_s - before.worker_idle_time_s
    fwd = stats.worker_forward_time_s - before.worker_forward_time_s
    tokens = sum(len(o.token_ids) for o in outs)
    return {"engine": "pagedserve", "seconds": elapsed, "generated_tokens": tokens,
            "tokens_per_s": tokens / elapsed, "preemptions": stats.num_preemptions_recompute
            + stats.num_preemptions_swap, "worker_idle_pct": 100 * idle / (idle + fwd) if idle + fwd else 0.0,
            "steps": stats.step - before.step,
            "token_ids": [o.token_ids for o in outs]}


def run_transformers(ns: argparse.Namespace, prompts: list[list[int]]) -> Optional[dict]:
    import torch
    import transformers
    from transformers import GenerationConfig

    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ns.model, dtype=torch.float32, attn_implementation=ns.peer).eval()
    config = GenerationConfig(max_new_tokens=ns.output_len, do_sample=False, eos_token_id=-1,
                              pad_token_id=model.generation_config.pad_token_id or 0)
    model.generate_batch(prompts[:2], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=config.pad_token_id))  # warm up
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config, progress_bar=True)
    elapsed = time.perf_counter() - start
    # generate_batch returns its results in input order
    token_ids = [list(r.generated_tokens) for r in results.values()]
    tokens = sum(len(t) for t in token_ids)
    return {"engine": f"transformers generate_batch ({ns.peer})", "seconds": elapsed,
            "generated_tokens": tokens, "tokens_per_s": tokens / elapsed, "token_ids": token_ids}


def main(ns: argparse.Namespace) -> int:
    with open(f"{ns.model}/config.json") as f:
        vocab = int(json.load(f).get("vocab_size") or 1000)
    prompts = make_prompts(ns.num_prompts, tuple(ns.input_len), min(vocab, 1000), ns.seed)
    print(f"model {ns.model}: {ns.num_prompts} prompts of {ns.input_len[0]}-{ns.input_len[1]} tokens, "
          f"{ns.output_len} output tokens each, greedy, float32, {ns.device}")
    ours = run_pagedserve(ns, prompts)
    rows = [ours]
    peer = None if ns.peer == "none" else run_transformers(ns, prompts)
    if peer:
        rows.append(peer)
    print(f"{'engine':<40} {'seconds':>8} {'tokens':>7} {'tok/s':>9}")
    for r in rows:
        print(f"{r['engine']:<40} {r['seconds']:8.2f} {r['generated_tokens']:7d} {r['tokens_per_s']:9.1f}")
    print(f"pagedserve: preemptions {ours['preemptions']}, worker idle {ours['worker_idle_pct']:.1f}% of step")
    result = {"rows": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]}
    if peer:
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        result["ratio"] = ratio
        print(f"ratio pagedserve / transformers: {ratio:.2f}x")
        if not ns.no_check:
            same = sum(a == b for a, b in zip(ours["token_ids"], peer["token_ids"]))
            result["identical_outputs"] = same
            print(f"identical greedy outputs: {same}/{len(prompts)}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
