"""Decode tokens/s of one model natively and through the transformers backend, in one process.

    python bench/scripts/transformers_backend_bench.py [--shape small-llama] [--arch gpt_oss] [--batch 1 16]

A real Scheduler drives each ModelRunner (``--model-impl native`` and ``transformers``) over the same
random model and prompts; only steps in which every scheduled request decodes one token are timed, in
``--rounds`` alternated runs of each, the best kept. ``--arch`` builds the shape as another family
(gpt_oss: 8 experts of a third of the shape's intermediate size, top 2, a window of 128 on every
other layer, head_dim = hidden / heads).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from pagedserve.bench.shapes import SHAPES
from pagedserve.protocol.messages import AddRequest, SamplingParams, WorkerInit
from pagedserve.scheduler_proc.config import SchedulerConfig
from pagedserve.scheduler_proc.scheduler import Scheduler
from pagedserve.tools.demo_model import build_model_dir
from pagedserve.worker_proc.model_runner import ModelRunner

# The family's own fields at a shape (besides its hidden size, layers and heads).
ARCH_FIELDS = {
    "llama": lambda shape: {},
    "gpt_oss": lambda shape: dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
                                  intermediate_size=shape["intermediate_size"] // 3,
                                  head_dim=shape["hidden_size"] // shape["num_heads"]),
}


def decode_tokens_per_s(runner: ModelRunner, batch: int, prompt_len: int, output_len: int) -> float:
    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=1024, max_num_seqs=batch, max_num_batched_tokens=2048,
                          max_model_len=2048)
    runner.init_cache(WorkerInit(block_size=16, num_gpu_blocks=1024, num_cpu_blocks=0, max_model_len=2048, seed=0))
    sched = Scheduler(cfg)
    generator = torch.Generator().manual_seed(0)
    vocab = runner.spec.vocab_size
    for i in range(batch):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        sched.add_request(AddRequest(f"r{i}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                                     ignore_eos=True)))
    tokens, seconds = 0, 0.0
    while sched.has_unfinished():
        out = sched.schedule()
        started = time.perf_counter()
        result = runner.execute(out)
        elapsed = time.perf_counter() - started
        decodes = len(out.decodes.req_ids)
        if decodes and out.total_num_scheduled_tokens == decodes:
            tokens, seconds = tokens + decodes, seconds + elapsed
        sched.update_from_output(out, result)
    return tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small-llama", choices=sorted(SHAPES))
    p.add_argument("--arch", default="llama", choices=sorted(ARCH_FIELDS))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPES[args.shape].model
        model = build_model_dir(tmp, **{**shape, "arch": args.arch, **ARCH_FIELDS[args.arch](shape)})
        runners = {impl: ModelRunner(str(model), model_impl=impl) for impl in ("native", "transformers")}
        print(f"{args.shape} as {args.arch}, float32, {torch.get_num_threads()} threads; decode tokens/s")
        print(f"{'batch':>5} {'native':>9} {'transformers':>13} {'ratio':>6}")
        for batch in args.batch:
            rates = dict.fromkeys(runners, 0.0)
            for _ in range(args.rounds):  # alternated, the best of each: a shared machine's noise only slows
                for impl, r in runners.items():
                    rates[impl] = max(rates[impl], decode_tokens_per_s(r, batch, args.prompt_len, args.output_len))
            print(f"{batch:>5} {rates['native']:>9.1f} {rates['transformers']:>13.1f} "
                  f"{rates['transformers'] / rates['native']:>6.2f}")


if __name__ == "__main__":
    main()
