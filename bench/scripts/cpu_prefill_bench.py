"""CPU prefill attention of one layer: the native kernel (kernels/cpu_prefill_attention.c)
against one SDPA call per chunk (worker_proc/prefill_attention.py, the torch path), for a
step's fresh prompts and for chunks after cached context, on the bench shapes' heads.

Prints ms per layer call (median of --repeat timed loops) and the largest difference.

    python bench/scripts/cpu_prefill_bench.py [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import random

import torch

from cpu_attention_bench import native_bench_args, time_ms
from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.native_prefill import plan_native_prefill
from pagedserve.worker_proc.prefill_attention import PrefillChunk, plan_prefill_chunk, prefill_attention

# name, q heads, kv heads, head dim, prompt lengths (min, max), step tokens
CASES = [
    ("llama-3layer, 1024-token step", 4, 2, 32, (64, 256), 1024),
    ("llama-3layer, one 160 prompt", 4, 2, 32, (160, 160), 160),
    ("small, 1024-token step", 8, 2, 64, (8, 256), 1024),
    ("0.5b, 1024-token step", 14, 2, 64, (8, 256), 1024),
    ("0.5b, one 2k prompt", 14, 2, 64, (2048, 2048), 2048),
]
# name, q heads, kv heads, head dim, cached context, chunk length
CONTEXT_CASES = [
    ("llama-3layer, 64 after 1000", 4, 2, 32, 1000, 64),
    ("llama-3layer, 512 after 512", 4, 2, 32, 512, 512),
    ("0.5b, 128 after 896", 14, 2, 64, 896, 128),
]
BLOCK_SIZE = 16


def main() -> None:
    ns = native_bench_args(__doc__)
    rng = random.Random(0)
    print(f"one layer's prefill attention, {ns.threads} thread(s), median of {ns.repeat}")
    print(f"{'case':<32}{'SDPA ms':>9}{'native ms':>11}{'speedup':>9}{'max diff':>10}")
    for name, q_heads, kv_heads, head_dim, lengths, step in CASES:
        lens = []
        while sum(lens) < step:
            lens.append(min(rng.randint(*lengths), step - sum(lens)))
        firsts = [sum(lens[:i]) for i in range(len(lens))]
        qkv = torch.randn(step, (q_heads + 2 * kv_heads) * head_dim)
        query = qkv[:, :q_heads * head_dim].view(step, q_heads, head_dim)
        key = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(step, kv_heads, head_dim)
        value = qkv[:, (q_heads + kv_heads) * head_dim:].view(step, kv_heads, head_dim)
        cache = torch.empty(1, 1, kv_heads, head_dim)  # never read: every chunk is on its own keys
        chunks = [PrefillChunk(f, f + n, n, None) for f, n in zip(firsts, lens)]
        first, length, scale = torch.tensor(firsts), torch.tensor(lens), head_dim ** -0.5

        def sdpa():
            return torch.cat([prefill_attention(query[c.start:c.end], key[c.start:c.end], value[c.start:c.end],
                                                cache, cache, c, scale, None) for c in chunks])

        def native():
            out = torch.empty(step, q_heads, head_dim)
            cpu_native.prefill_attention(query, key, value, out, first, length, scale)
            return out

        report(name, sdpa, native, ns.repeat)
    for name, q_heads, kv_heads, head_dim, context, length in CONTEXT_CASES:
        seq_len = context + length
        num_blocks = -(-seq_len // BLOCK_SIZE)
        k_cache = torch.randn(num_blocks + 8, BLOCK_SIZE, kv_heads, head_dim)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(num_blocks + 8)[:num_blocks].to(torch.int32)  # scattered, as after churn
        chunk = plan_prefill_chunk(0, length, seq_len, table, BLOCK_SIZE)
        query = torch.randn(length, q_heads, head_dim)
        key, value = torch.randn(length, kv_heads, head_dim), torch.randn(length, kv_heads, head_dim)  # SDPA reads the cache
        plan, scale = plan_native_prefill([chunk], None), head_dim ** -0.5

        def sdpa():
            return prefill_attention(query, key, value, k_cache, v_cache, chunk, scale, None)

        def native():
            out = torch.empty(length, q_heads, head_dim)
            plan.run(query, key, value, k_cache, v_cache, out, scale)
            return out

        report(name, sdpa, native, ns.repeat)


def report(name, sdpa, native, repeat: int) -> None:
    diff = (sdpa() - native()).abs().max().item()
    sdpa_ms, native_ms = time_ms(sdpa, repeat, loops=10), time_ms(native, repeat, loops=10)
    print(f"{name:<32}{sdpa_ms:9.3f}{native_ms:11.3f}{sdpa_ms / native_ms:8.1f}x{diff:10.1e}")


if __name__ == "__main__":
    main()
