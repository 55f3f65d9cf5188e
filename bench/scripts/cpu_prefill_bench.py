"""CPU prefill attention of one layer: the native kernel (kernels/cpu_prefill_attention.c)
against one SDPA call per chunk (worker_proc/prefill_attention.py, the torch path), for a
step's fresh prompts and for chunks after cached context, on the bench shapes' heads.

Prints ms per layer call (median of --repeat timed loops) and the largest difference. With
--dtype bfloat16 or float16 the rows and caches are in that dtype, and a third column times
SDPA called in that dtype itself (torch's own half precision kernel, no widening).

    python bench/scripts/cpu_prefill_bench.py [--threads 1] [--repeat 5] [--dtype float32]
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from cpu_attention_bench import native_bench_args, time_ms
from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.native_prefill import plan_native_prefill
from pagedserve.worker_proc.prefill_attention import (PrefillChunk, _visibility, plan_prefill_chunk,
                                                      prefill_attention)

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
    dtype, half = ns.dtype, ns.dtype != torch.float32
    print(f"one layer's prefill attention, {dtype}, {ns.threads} thread(s), median of {ns.repeat}")
    print(f"{'case':<32}{'SDPA ms':>9}{'native ms':>11}{'speedup':>9}{'max diff':>10}"
          + (f"{'SDPA in ' + str(dtype)[6:] + ' ms':>22}" if half else ""))
    for name, q_heads, kv_heads, head_dim, lengths, step in CASES:
        lens = []
        while sum(lens) < step:
            lens.append(min(rng.randint(*lengths), step - sum(lens)))
        firsts = [sum(lens[:i]) for i in range(len(lens))]
        qkv = torch.randn(step, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
        query = qkv[:, :q_heads * head_dim].view(step, q_heads, head_dim)
        key = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(step, kv_heads, head_dim)
        value = qkv[:, (q_heads + kv_heads) * head_dim:].view(step, kv_heads, head_dim)
        cache = torch.empty(1, 1, kv_heads, head_dim, dtype=dtype)  # never read: every chunk is on its own keys
        chunks = [PrefillChunk(f, f + n, n, None) for f, n in zip(firsts, lens)]
        first, length, scale = torch.tensor(firsts), torch.tensor(lens), head_dim ** -0.5

        def sdpa():
            return torch.cat([prefill_attention(query[c.start:c.end], key[c.start:c.end], value[c.start:c.end],
                                                cache, cache, c, scale, None) for c in chunks])

        def native():
            out = torch.empty(step, q_heads, head_dim, dtype=dtype)
            cpu_native.prefill_attention(query, key, value, out, first, length, scale)
            return out

        def sdpa_in_dtype():
            return torch.cat([sdpa_unwidened(query[c.start:c.end], key[c.start:c.end], value[c.start:c.end], None,
                                             scale) for c in chunks])

        report(name, sdpa, native, ns.repeat, sdpa_in_dtype if half else None)
    for name, q_heads, kv_heads, head_dim, context, length in CONTEXT_CASES:
        seq_len = context + length
        num_blocks = -(-seq_len // BLOCK_SIZE)
        k_cache = torch.randn(num_blocks + 8, BLOCK_SIZE, kv_heads, head_dim).to(dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(num_blocks + 8)[:num_blocks].to(torch.int32)  # scattered, as after churn
        chunk = plan_prefill_chunk(0, length, seq_len, table, BLOCK_SIZE)
        query = torch.randn(length, q_heads, head_dim).to(dtype)
        key, value = (torch.randn(length, kv_heads, head_dim).to(dtype) for _ in range(2))
        # (SDPA reads the cache: key and value only stand in for this step's rows)
        plan, scale = plan_native_prefill([chunk], None), head_dim ** -0.5

        def sdpa():
            return prefill_attention(query, key, value, k_cache, v_cache, chunk, scale, None)

        def native():
            out = torch.empty(length, q_heads, head_dim, dtype=dtype)
            plan.run(query, key, value, k_cache, v_cache, out, scale)
            return out

        def sdpa_in_dtype():
            keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, chunk.context_slots)
            values = v_cache.view(-1, kv_heads, head_dim).index_select(0, chunk.context_slots)
            return sdpa_unwidened(query, keys, values, _visibility(length, seq_len, 0, None), scale)

        report(name, sdpa, native, ns.repeat, sdpa_in_dtype if half else None)


def sdpa_unwidened(query, keys, values, mask, scale):
    """prefill_attention's SDPA call without its float32 copies: torch's kernel in the rows' dtype."""
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=query.shape[1] != keys.shape[1])
    return out[0].transpose(0, 1)


def report(name, sdpa, native, repeat: int, sdpa_in_dtype=None) -> None:
    diff = (sdpa().float() - native().float()).abs().max().item()
    sdpa_ms, native_ms = time_ms(sdpa, repeat, loops=10), time_ms(native, repeat, loops=10)
    line = f"{name:<32}{sdpa_ms:9.3f}{native_ms:11.3f}{sdpa_ms / native_ms:8.1f}x{diff:10.1e}"
    if sdpa_in_dtype is not None:
        line += f"{time_ms(sdpa_in_dtype, repeat, loops=10):22.3f}"
    print(line)


if __name__ == "__main__":
    main()
