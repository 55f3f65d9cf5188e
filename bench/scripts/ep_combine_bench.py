"""One MoE layer's experts on two gloo ranks (CPU), per token count: every expert sliced (tensor parallel),
whole experts with the all-reduce combine, and whole experts exchanged all-to-all (models/expert_parallel.py);
each time is the block's forward plus the layer's all-reduce, the median over the runs, on rank 0.

    python -P bench/scripts/ep_combine_bench.py [--hidden 1024 --experts 16 --inter 512 --top-k 2 --threads 1]

Spawns its two ranks itself (this file again, with --rank). The three outputs are checked to agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKENS = (1, 8, 64, 256, 1024)
MODES = {"tp (sliced experts)": (False, "0"), "ep all-reduce": (True, "0"), "ep all-to-all": (True, "1")}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pagedserve.worker_proc.elementwise import select_elementwise
    from pagedserve.worker_proc.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    rows, outputs = {}, {}
    for mode, (expert_parallel, all_to_all) in MODES.items():
        os.environ["PAGEDSERVE_EP_ALL_TO_ALL"] = all_to_all
        runner = ModelRunner(args.model, tp_rank=args.rank, tp_size=2, expert_parallel=expert_parallel)
        block, shard = runner.model.layers[0].moe, runner.shard
        ew = select_elementwise(runner.ops, runner.dtype)
        for tokens in TOKENS:
            x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens))  # alike on both

            def step():
                return shard.all_reduce(block.forward(x, ew))

            times = []
            for i in range(args.repeat + 2):
                dist.barrier()  # both ranks start together: the time is the slower rank's
                start = time.perf_counter()
                out = step()
                if i >= 2:
                    times.append(time.perf_counter() - start)
            rows.setdefault(tokens, {})[mode] = statistics.median(times) * 1e3
            outputs.setdefault(tokens, []).append(out)
        del runner
    if args.rank == 0:
        agree = {t: max(float((o - outs[0]).abs().max()) for o in outs) for t, outs in outputs.items()}
        print(json.dumps({"ms": rows, "max_abs_diff": agree}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch + gloo may abort in static destructors at exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    from pagedserve.tools.demo_model import build_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "moe", "qwen3_moe", hidden_size=args.hidden, num_layers=1, num_heads=8,
                                num_kv_heads=2, num_experts=args.experts, num_experts_per_tok=args.top_k,
                                moe_intermediate_size=args.inter)
        common = [sys.executable, "-P", __file__, *sys.argv[1:], "--model", str(model)]
        ranks = [subprocess.Popen([*common, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(2)]
        out = [r.communicate()[0] for r in ranks]
    result = json.loads(out[0].strip().splitlines()[-1])
    print(f"hidden {args.hidden}, {args.experts} experts of {args.inter}, top {args.top_k}, 2 gloo ranks x "
          f"{args.threads} thread(s); ms per layer (experts + the layer's all-reduce), median of {args.repeat}")
    print(f"{'tokens':>7} " + " ".join(f"{m:>20}" for m in MODES) + "   max |diff|")
    for tokens, times in result["ms"].items():
        print(f"{tokens:>7} " + " ".join(f"{times[m]:>20.3f}" for m in MODES) +
              f"   {result['max_abs_diff'][tokens]:.2e}")


if __name__ == "__main__":
    main()
