"""A one-stream decode step's matmuls, alone: the 0.5B shape's 24 layers of qkv, o, gate_up and down
and its lm_head (random weights, 0.988 GB in bfloat16), through each path worker_proc/models/linear.py can
take at 1-8 rows: kernels/cpu_gemv.c's bfloat16 panels and its row-major kernel on the weights as loaded,
oneDNN's packed weights, F.linear; and ``int4``: the layers as int4 in groups (kernels/cpu_gemv_int4.c, random
nibbles; ``--int4-group``, symmetric) with lm_head in bfloat16 panels, as a W4A16 checkpoint serves them. In
the same run, the memory's read bandwidth over the bfloat16 bytes (the max of each weight viewed as int32, and
the sum of one 1 GiB tensor), so every path is given as GB/s of the bytes it reads and % of what this machine
reads now. Paths alternate within each repeat; medians and ranges over the repeats.

    python bench/scripts/gemv_bench.py [--rows 1,2,4,8] [--repeat 7] [--dtype bfloat16] [--threads 2]
    python bench/scripts/gemv_bench.py --threads 1 --cpu-time    # one core, on a loaded machine
    python bench/scripts/gemv_bench.py --threads 1 --cpu-time --paths panels,int4 --int4-group 32   # Q4_0's groups
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native, cpu_quantized

# (out, in) of the 0.5B's projections, q/k/v and gate/up fused as the worker fuses them
LAYER = ((1152, 896), (896, 896), (9728, 896), (896, 4864))
LM_HEAD = (151936, 896)


CLOCK = time.perf_counter


def timed(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--paths", default="panels,gemv,packed,F.linear",
                   help="panels: cpu_gemv.c's bfloat16 vdpbf16ps panels; gemv: its row-major kernel; int4: "
                        "cpu_gemv_int4.c on the layers, panels on lm_head")
    p.add_argument("--int4-group", type=int, default=128)
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this thread's CPU time (robust to other processes' load; use with --threads 1)")
    ns = p.parse_args()
    global CLOCK
    if ns.cpu_time:
        CLOCK = time.thread_time
    if ns.threads:
        torch.set_num_threads(ns.threads)
    dtype = getattr(torch, ns.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(n, k).mul_(0.05).to(dtype) for _ in range(ns.layers) for n, k in LAYER]
    weights.append(torch.randn(*LM_HEAD).mul_(0.05).to(dtype))
    total = sum(w.numel() * w.element_size() for w in weights)
    paths = ns.paths.split(",")
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights] if "packed" in paths else None
    panels = ([cpu_native.pack_gemv_panels(w) for w in weights]
              if "panels" in paths and dtype == torch.bfloat16 and cpu_native.supports_gemv_panels() else None)
    if panels is None and "panels" in paths:
        paths.remove("panels")
    int4 = None
    if "int4" in paths:
        g = ns.int4_group
        int4 = [(cpu_quantized.pack_int4_blocks(torch.randint(0, 16, w.shape, dtype=torch.uint8)),
                 torch.rand(w.shape[0], w.shape[1] // g) * 0.01) for w in weights[:-1]]
        head_panels = cpu_native.pack_gemv_panels(weights[-1].bfloat16())
    # the bytes each path reads a step
    path_bytes = {path: total for path in paths}
    if int4 is not None:
        path_bytes["int4"] = sum(q.nbytes + s.nbytes for q, s in int4) + head_panels.nbytes
    big = torch.ones(1 << 28)  # 1 GiB, touched
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, gemv variant {cpu_native.gemv_variant()}, "
          f"{ns.dtype} weights {total / 1e9:.3f} GB ({len(weights)} matrices)")

    def step(path: str, xs: dict) -> tuple[float, float]:
        """(seconds for all matrices, seconds for lm_head)"""
        start = CLOCK()
        for i, w in enumerate(weights):
            x = xs[w.shape[1]]
            if i == len(weights) - 1:
                head = CLOCK()
            if path == "int4":
                if i == len(weights) - 1:
                    cpu_native.gemv_panels(x.bfloat16(), head_panels, w.shape[0])
                else:
                    cpu_quantized.gemv_int4_blocks(x, *int4[i], None, ns.int4_group)
            elif path == "panels":
                cpu_native.gemv_panels(x, panels[i], w.shape[0])
            elif path == "gemv":
                cpu_native.gemv(x, w)
            elif path == "packed":
                torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
            else:
                F.linear(x, w)
        end = CLOCK()
        return end - start, end - head

    reads = {"read (max of each weight)": [], "read (sum of 1 GiB)": []}
    results = {(path, rows): ([], []) for rows in map(int, ns.rows.split(",")) for path in paths}
    for r in range(ns.repeat + 1):  # the first round warms up, untimed
        reads_now = {"read (max of each weight)": timed(lambda: [w.view(torch.int32).amax() for w in weights]),
                     "read (sum of 1 GiB)": timed(big.sum)}
        if r:
            for name, t in reads_now.items():
                reads[name].append(t)
        for path, rows in results:
            xs = {k: torch.randn(rows, k).to(dtype) for k in (896, 4864)}
            t, head = step(path, xs)
            if r:
                results[path, rows][0].append(t)
                results[path, rows][1].append(head)
    read_gbs = statistics.median(total / t / 1e9 for t in reads["read (max of each weight)"])
    big_gbs = statistics.median((1 << 30) / t / 1e9 for t in reads["read (sum of 1 GiB)"])
    for name, ts in reads.items():
        size = total if "each" in name else 1 << 30
        print(f"{name}: {statistics.median(size / t / 1e9 for t in ts):.1f} GB/s "
              f"({min(size / t / 1e9 for t in ts):.1f}-{max(size / t / 1e9 for t in ts):.1f})")
    limit = max(read_gbs, big_gbs)
    print(f"| rows | path | step matmuls ms (range) | GB/s | % of read {limit:.1f} GB/s | lm_head ms | lm_head GB/s |")
    print("|---|---|---|---|---|---|---|")
    head_bytes = weights[-1].numel() * weights[-1].element_size()
    for (path, rows), (ts, heads) in results.items():
        t, h = statistics.median(ts), statistics.median(heads)
        size = path_bytes[path]
        print(f"| {rows} | {path} | {1e3 * t:.2f} ({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}) | {size / t / 1e9:.1f} | "
              f"{100 * size / t / 1e9 / limit:.0f}% | {1e3 * h:.2f} | {head_bytes / h / 1e9:.1f} |")
    if int4 is not None:
        print(f"int4: {path_bytes['int4'] / 1e9:.3f} GB a step (layers int4 g{ns.int4_group} "
              f"{(path_bytes['int4'] - head_panels.nbytes) / 1e9:.3f} GB, lm_head bfloat16)")


if __name__ == "__main__":
    main()
