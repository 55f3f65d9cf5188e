"""Greedy parity with transformers on a CUDA GPU, through the real multi-process engine.

    python bench/scripts/cuda_check.py            # needs a GPU; prints one row per case

The test suite runs on CPU only (CI has no GPU). This is what a GPU session runs to check
that the CUDA path (Triton kernels, pinned host swap, the zeroing rule on the GPU stream,
async scheduling) serves transformers' own greedy tokens: float32 with TF32 off on both
sides, so any difference is a bug, not rounding.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

CASES = (
    # (name, architecture, engine options[, environment of the engine's processes])
    ("qwen2 plain (decode steps replay CUDA graphs)", "qwen2", {}),
    ("qwen2 --enforce-eager", "qwen2", dict(enforce_eager=True)),
    ("qwen2 chunked prefill 16, poisoned cache", "qwen2",
     dict(max_num_batched_tokens=16, max_num_seqs=16, poison_kv_cache=True)),
    ("llama tight cache, swap", "llama", dict(num_gpu_blocks=24, preemption_mode="swap", poison_kv_cache=True)),
    ("llama tight cache, recompute", "llama", dict(num_gpu_blocks=24, preemption_mode="recompute")),
    ("qwen3 sync scheduling", "qwen3", dict(async_scheduling=False)),
    ("qwen2 prefix caching", "qwen2", dict(enable_prefix_caching=True, block_size=4)),
    # The fused elementwise kernels serve half precision by default; float32 puts them under
    # the oracle (their norm sums in another order, so a near-tie could differ).
    ("qwen3 fused elementwise ops, graphs", "qwen3", {}, {"PAGEDSERVE_FUSED_OPS": "1"}),
)


def hf_greedy_all(model_dir: str, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    gen = model.generation_config
    gen.do_sample, gen.max_new_tokens, gen.pad_token_id, gen.eos_token_id = False, new_tokens, 0, []
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=device), generation_config=gen)
            outs.append(out[0, len(ids):].tolist())
    return outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda", help="cpu only checks this script itself")
    p.add_argument("--cases", nargs="+", help="only the cases whose name contains one of these")
    ns = p.parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA GPU here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from pagedserve.tools.demo_model import build_model_dir
    from pagedserve.offline.llm import LLM, SamplingParams

    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]  # a common prefix for the prefix-cache case
    prompts = [shared[:rng.randint(0, 40)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 90))]
               for _ in range(ns.prompts)]
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        models, oracle = {}, {}
        for name, arch, options, *env in CASES:
            if ns.cases and not any(part in name for part in ns.cases):
                continue
            if arch not in models:
                models[arch] = str(build_model_dir(f"{tmp}/{arch}", arch, num_layers=3, hidden_size=128,
                                                   num_heads=4, num_kv_heads=2, intermediate_size=256))
                oracle[arch] = hf_greedy_all(models[arch], prompts, ns.new_tokens, ns.device)
            start = time.perf_counter()
            saved = dict(os.environ)
            os.environ.update(env[0] if env else {})
            try:
                with LLM(models[arch], device=ns.device, dtype="float32", **options) as llm:
                    outs = llm.generate(prompts, SamplingParams(max_tokens=ns.new_tokens, temperature=0.0,
                                                                ignore_eos=True), use_tqdm=False)
                    stats = llm.refresh_stats()[0]
            finally:
                os.environ.clear()
                os.environ.update(saved)
            same = sum(list(o.token_ids) == want for o, want in zip(outs, oracle[arch]))
            failed += same != len(prompts)
            preempted = stats.num_preemptions_recompute + stats.num_preemptions_swap
            rows.append((name, f"{same}/{len(prompts)}", preempted, time.perf_counter() - start))
    print(f"\n{'case':<48} {'identical':>9} {'preemptions':>11} {'seconds':>8}")
    for name, same, preempted, seconds in rows:
        print(f"{name:<48} {same:>9} {preempted:>11} {seconds:8.1f}")
    where = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    print(f"{where}, torch {torch.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
