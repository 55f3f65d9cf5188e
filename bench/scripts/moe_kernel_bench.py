"""One mixture-of-experts layer's routed experts on CPU in bfloat16, the per-expert path against the one-call
kernel, at Qwen3-30B-A3B's expert shape (128 experts, top 8, hidden 2048, moe_intermediate 768; 9.44 MB an
expert, 1.2 GB a layer):

- per expert: worker_proc/models/moe.py's ``grouped_experts`` over oneDNN's packed weights (the layout a model
  too large for two copies keeps: ``expert_layout``), two calls per active expert;
- one call: kernels/cpu_moe.py's ``NativeExperts`` (kernels/cpu_moe.c), every active expert in one call.

Each call gets a fresh random routing (the same sequence for both paths), so an expert's weights come from
memory, as in a model's step, not from the caches the previous call filled. The paths alternate within each
repeat; medians and ranges over the repeats. GB/s: the active experts' bytes (distinct experts x 9.44 MB) over
the time; in the same run the memory's read bandwidth (the sum of a 512 MiB tensor) for scale.

    python bench/scripts/moe_kernel_bench.py [--tokens 1,4,16,64] [--repeat 9] [--threads 2]
    python bench/scripts/moe_kernel_bench.py --cpu-time       # one thread's CPU time (a loaded machine)
    python bench/scripts/moe_kernel_bench.py --cpu-time --march x86-64-v3   # what an AVX2 machine runs

``--march``: both paths on the kernels as built for that x86-64 level (kernels/cpu_native.py ``_build``), the
per-expert path in the layout such a CPU takes: cpu_linear.c's panels on x86-64-v3 (AVX2, no AVX-512), oneDNN's
packed weights otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.cpu_moe import NativeExperts
from pagedserve.kernels.moe_routing import RoutingRule, route
from pagedserve.worker_proc.elementwise import TorchElementwise
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout
from pagedserve.worker_proc.models.moe import _layout_name, grouped_experts

HIDDEN, SIZE, EXPERTS, TOP_K = 2048, 768, 128, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    p.add_argument("--paths", default="per expert,one call")
    p.add_argument("--march", default="native", help="the kernels as built for this -march (x86-64-v4, x86-64-v3)")
    ns = p.parse_args()
    clock = time.thread_time if ns.cpu_time else time.perf_counter
    if ns.cpu_time:
        ns.threads = 1
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.march != "native":
        lib = cpu_native._build(ns.march)
        cpu_native.library = lambda: lib
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * SIZE, HIDDEN, generator=g) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, SIZE, generator=g) * 0.02).bfloat16()
    paths = ns.paths.split(",")
    calls = {}
    if "per expert" in paths:
        layout = (WeightLayout(plain=False, native=True) if ns.march == "x86-64-v3"
                  else WeightLayout(packed=True, plain=False))
        experts = [(LinearWeight.of(gate_up[e], None, layout, gate_size=SIZE), LinearWeight.of(down[e], None, layout))
                   for e in range(EXPERTS)]
        ew = TorchElementwise()
        calls["per expert"] = lambda x, w, i: grouped_experts(x, experts, w, i, ew)
    if "one call" in paths:
        native = NativeExperts(list(gate_up), list(down))
        calls["one call"] = native
    del gate_up, down
    expert_bytes = (2 * SIZE * HIDDEN + HIDDEN * SIZE) * 2
    big = torch.ones(1 << 27)  # 512 MiB, touched
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'thread CPU' if ns.cpu_time else 'wall'} "
          f"clock, kernel variant {cpu_native.kernel_variant()} (-march={ns.march}); H={HIDDEN} I={SIZE} E={EXPERTS} "
          f"top-{TOP_K} bfloat16; per expert: {_layout_name(experts[0][0]) if 'per expert' in calls else '-'}")
    token_counts = [int(t) for t in ns.tokens.split(",")]
    times = {(t, name): [] for t in token_counts for name in calls}
    active = {t: [] for t in token_counts}
    reads = []
    for r in range(ns.repeat + 1):  # the first round warms up, untimed
        start = clock()
        big.sum()
        if r:
            reads.append(big.nbytes / (clock() - start) / 1e9)
        for tokens in token_counts:
            x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
            weights, ids = route(torch.randn(tokens, EXPERTS, generator=g).bfloat16(), RoutingRule(TOP_K, True))
            if r:
                active[tokens].append(len(ids.unique()))
            outs = []
            for name, call in (calls.items() if r % 2 else reversed(calls.items())):
                start = clock()
                outs.append(call(x, weights, ids))
                if r:
                    times[tokens, name].append(clock() - start)
            if len(outs) == 2 and r == 1:
                diff = (outs[0].float() - outs[1].float()).abs().max().item()
                print(f"{tokens} tokens: the two paths' outputs differ by at most {diff:.3g}")
    read = statistics.median(reads)
    print(f"memory read bandwidth (sum of 512 MiB): {read:.1f} GB/s ({min(reads):.1f}-{max(reads):.1f})")
    print(f"| tokens | active experts (median) | path | ms (median, range) | GB/s | % of read |")
    print("|---|---|---|---|---|---|")
    for (tokens, name), ts in times.items():
        gbs = statistics.median(a * expert_bytes / t / 1e9 for a, t in zip(active[tokens], ts))
        print(f"| {tokens} | {statistics.median(active[tokens])} | {name} | {1e3 * statistics.median(ts):.2f} "
              f"({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}) | {gbs:.1f} | {100 * gbs / read:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
