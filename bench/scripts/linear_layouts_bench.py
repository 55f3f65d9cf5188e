"""The 0.5B shape's projections through each CPU matmul layout that worker_proc/models/linear.py
can choose: the native kernel's panels (kernels/cpu_linear.c, where it is built), oneDNN's packed
weight, ``F.linear`` (oneMKL, x @ W.T) and ``x @ W_t`` (an [in, out] copy), per row count. Prints
ms per call (median of --repeat) and GFLOP/s, and which was fastest.

This, not one square matmul, decides whether a layout pays for a second copy of the weights:
the square 4096^3 product of ``step_profile.py --limits`` favours oneMKL more than these shapes do.

    python bench/scripts/linear_layouts_bench.py [--rows 1,2,8,32,64,128,256,512,1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native

from step_phases import timed_runs

# name: (in, out) of Qwen2.5-0.5B's projections (q, k and v fused; gate and up fused)
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,8,32,64,128,256,512,1024")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=0, help="timed calls (default: 20 up to 64 rows, 7 above)")
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    native = cpu_native.supports_linear()
    print(f"| weight | rows |{' native ms (GFLOP/s) |' if native else ''} packed | F.linear | x @ W_t | fastest |")
    print("|---|---|---|---|---|---|" + ("---|" if native else ""))
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k) * 0.02
        layouts = {"packed": torch.ops.mkldnn._reorder_linear_weight(weight, None), "F.linear": weight,
                   "x @ W_t": weight.t().contiguous()}
        if native:
            layouts["native"] = cpu_native.pack_linear_weight(weight)
        for m in (int(r) for r in ns.rows.split(",")):
            x = torch.randn(m, k)
            calls = {"packed": lambda: torch.ops.mkldnn._linear_pointwise(x, layouts["packed"], None, "none", [], ""),
                     "F.linear": lambda: F.linear(x, weight), "x @ W_t": lambda: torch.mm(x, layouts["x @ W_t"])}
            if native:
                calls = {"native": lambda: cpu_native.linear(x, layouts["native"], n), **calls}
            repeat = ns.repeat or (20 if m <= 64 else 7)
            times = {kind: statistics.median(timed_runs(call, repeat, warmup=2)) for kind, call in calls.items()}
            gflop = 2 * m * k * n / 1e9
            cells = " | ".join(f"{1e3 * t:.3f} ({gflop / t:.0f})" for t in times.values())
            print(f"| {name} {k}x{n} | {m} | {cells} | {min(times, key=times.get)} |")


if __name__ == "__main__":
    main()
