"""CPU decode attention of one layer: the native kernel (kernels/cpu_native.py) against the
gather + SDPA torch path (worker_proc/decode_attention.py), on the bench shapes' heads.

Each case is a step's decodes over random context lengths, their blocks scattered over a
cache sized for them (as a worker's cache is after some churn). Prints ms per layer call,
median of --repeat timed loops, and the largest difference between the two paths. --dtype
bfloat16 or float16 runs the cache and queries in that dtype (the half precision kernels).

    python bench/scripts/cpu_attention_bench.py [--threads 1] [--repeat 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc import decode_attention as da

# name, decodes, q heads, kv heads, head dim, context lengths (min, max)
CASES = [
    ("llama-3layer, 64 decodes", 64, 4, 2, 32, (64, 384)),
    ("small, 64 decodes", 64, 8, 2, 64, (16, 128)),
    ("small, 64 decodes of a served mix", 64, 8, 2, 64, (110, 590)),
    ("0.5b, 32 decodes", 32, 14, 2, 64, (8, 288)),
    ("0.5b, 8 decodes of 2k", 8, 14, 2, 64, (1800, 2200)),
    ("demo, 6 decodes (misaligned)", 6, 4, 2, 32, (7, 180)),
    ("demo, 1 decode", 1, 4, 2, 32, (80, 80)),
]
BLOCK_SIZE = 16


def make_case(decodes, q_heads, kv_heads, head_dim, lengths, generator, dtype=torch.float32):
    lens = torch.randint(lengths[0], lengths[1] + 1, (decodes,), generator=generator)
    per = [(int(n) + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
    num_blocks = sum(per) + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(decodes, max(per), dtype=torch.int32)
    for b, count in enumerate(per):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    query = torch.randn(decodes, q_heads, head_dim, generator=generator).to(dtype)
    return query, k_cache, v_cache, tables, lens.to(torch.int32)


def time_ms(fn, repeat: int, loops: int = 50) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - start) / loops * 1e3)
    return statistics.median(runs)


def native_bench_args(doc: str) -> argparse.Namespace:
    """--threads (set for torch and the kernels), --repeat and --dtype; exits where the kernels did
    not build, and says which CPU and which kernel variant ran."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ns = p.parse_args()
    ns.dtype = getattr(torch, ns.dtype)
    torch.set_num_threads(ns.threads)
    if cpu_native.library() is None:
        raise SystemExit("the native kernels did not build here (see the log); nothing to compare")
    print(f"{cpu_model()}; kernel variant {cpu_native.kernel_variant()}")
    return ns


def cpu_model() -> str:
    """The CPU's model name and the flags that pick a kernel variant, as every number needs beside it."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "CPU unknown"
    flags = set(info.get("flags", "").split())
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return f"{info.get('model name', 'CPU unknown')} ({' '.join(shown)})"


def main() -> None:
    ns = native_bench_args(__doc__)
    generator = torch.Generator().manual_seed(0)
    workspace = da.GatherWorkspace()
    print(f"one layer's decode attention, {ns.dtype}, {ns.threads} thread(s), block size {BLOCK_SIZE}, "
          f"median of {ns.repeat}")
    print(f"{'case':<32}{'torch path ms':>14}{'native ms':>11}{'speedup':>9}{'max diff':>10}")
    for name, decodes, q_heads, kv_heads, head_dim, lengths in CASES:
        query, k_cache, v_cache, tables, lens = make_case(decodes, q_heads, kv_heads, head_dim, lengths, generator,
                                                           ns.dtype)
        scale = head_dim ** -0.5

        def run(native: bool):
            context = da.build_decode_context(lens, tables, BLOCK_SIZE, None)
            if not native:
                context.workspace = workspace
                supports, da.cpu_native.supports_decode = da.cpu_native.supports_decode, lambda *_: False
                try:
                    return da.decode_attention(query, k_cache, v_cache, scale, context)
                finally:
                    da.cpu_native.supports_decode = supports
            return da.decode_attention(query, k_cache, v_cache, scale, context)

        diff = (run(True).float() - run(False).float()).abs().max().item()
        torch_ms, native_ms = time_ms(lambda: run(False), ns.repeat), time_ms(lambda: run(True), ns.repeat)
        print(f"{name:<32}{torch_ms:14.3f}{native_ms:11.3f}{torch_ms / native_ms:8.1f}x{diff:10.1e}")


if __name__ == "__main__":
    main()
