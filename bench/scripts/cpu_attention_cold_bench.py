"""A decode step's attention over all its layers, as a step reads them: each layer's cache in
turn, so every layer's keys and values come from DRAM (a step's caches outgrow the CPU's),
unlike cpu_attention_bench.py's one warm layer. Prints ms per step and the KV bytes read per
second against the machine's own streaming read, timed in the same run.

    python bench/scripts/cpu_attention_cold_bench.py [--threads 2] [--layers 8] [--repeat 7] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpu_attention_bench import cpu_model, make_case
from pagedserve.kernels import cpu_native

# the small shape's heads (8 query, 2 KV, 64 dims), 64 decodes of a served mix's lengths
DECODES, Q_HEADS, KV_HEADS, HEAD_DIM, LENGTHS = 64, 8, 2, 64, (110, 590)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ns = p.parse_args()
    dtype = getattr(torch, ns.dtype)
    torch.set_num_threads(ns.threads)
    if cpu_native.library() is None:
        raise SystemExit("the native kernels did not build here (see the log)")
    generator = torch.Generator().manual_seed(0)
    layers = [make_case(DECODES, Q_HEADS, KV_HEADS, HEAD_DIM, LENGTHS, generator, dtype) for _ in range(ns.layers)]
    first = torch.zeros(DECODES, dtype=torch.int64)

    def step() -> None:
        for query, k_cache, v_cache, tables, lens in layers:
            cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, first, lens.to(torch.int64) - 1,
                                              HEAD_DIM ** -0.5)

    def timed(fn, loops: int = 10) -> list[float]:
        for _ in range(3):
            fn()
        runs = []
        for _ in range(ns.repeat):
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            runs.append((time.perf_counter() - start) / loops)
        return runs

    kv_bytes = sum(2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * dtype.itemsize for *_, lens in layers)
    big = torch.empty(1 << 28, dtype=torch.uint8).view(torch.float32).normal_()
    stream = statistics.median(timed(lambda: big.sum(), loops=5))
    runs = timed(step)
    ms = 1e3 * statistics.median(runs)
    print(f"{cpu_model()}; kernel variant {cpu_native.kernel_variant()}; {ns.threads} thread(s); {ns.dtype}")
    print(f"{ns.layers} layers x {DECODES} decodes of {LENGTHS[0]}-{LENGTHS[1]} tokens, {Q_HEADS}/{KV_HEADS} heads "
          f"of {HEAD_DIM}: {ms:.2f} ms per step ({1e3 * min(runs):.2f}-{1e3 * max(runs):.2f}), "
          f"{kv_bytes / 1e6:.0f} MB of KV at {kv_bytes / 1e9 / (ms / 1e3):.1f} GB/s; "
          f"streaming read here {big.numel() * 4 / 1e9 / stream:.1f} GB/s")


if __name__ == "__main__":
    main()
