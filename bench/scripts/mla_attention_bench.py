"""One DeepSeek-V3 layer's attention on CPU over the latent cache (worker_proc/latent_attention.py).

Decodes: queries absorbing W_UK over the latent rows, then W_UV, against the same attention over a
per-head K/V cache (what the heads would keep expanded: K 192 dims, V 128 padded to 192 for the
one-head_dim kernel), both through the native decode kernel; each cache's bytes per token and layer.

Prompts (one chunk, no cached context): the absorbed form (SDPA, one 576-wide "KV head") against
the expanded one the worker runs (each head's K and V made from the latent rows, SDPA).

Prints ms per layer call, median of --repeat timed loops. Heads: 16 (one rank of eight: DeepSeek-V3's
128 heads at --tensor-parallel-size 8) and 128.

    python bench/scripts/mla_attention_bench.py [--threads 1] [--repeat 5] [--dtype bfloat16]
"""

from __future__ import annotations

import torch

from cpu_attention_bench import BLOCK_SIZE, make_case, native_bench_args, time_ms
from pagedserve.kernels import reference
from pagedserve.worker_proc.attention import plan_cpu_attention
from pagedserve.worker_proc.attention import attend
from pagedserve.worker_proc.latent_attention import expanded_chunk, latent_attention
from pagedserve.worker_proc import decode_attention as da

LATENT, ROPE, NOPE, V_DIM = 512, 64, 128, 128
# name, decodes, heads, context lengths (min, max)
PROMPTS = [(16, 256), (16, 1024)]  # heads, tokens
CASES = [
    ("16 heads, 8 decodes of 1k", 8, 16, (900, 1100)),
    ("16 heads, 32 decodes of 256", 32, 16, (200, 300)),
    ("128 heads, 4 decodes of 1k", 4, 128, (900, 1100)),
]


def main() -> None:
    ns = native_bench_args(__doc__)
    generator = torch.Generator().manual_seed(0)
    element = torch.empty((), dtype=ns.dtype).element_size()
    print(f"one DeepSeek-V3 layer's decode attention, {ns.dtype}, {ns.threads} thread(s), block size {BLOCK_SIZE}, "
          f"median of {ns.repeat}")
    print(f"{'case':<30}{'per-head K/V ms':>16}{'latent ms':>11}{'ratio':>8}{'bytes/token: K/V':>18}{'latent':>8}")
    for name, decodes, heads, lengths in CASES:
        query, cache, _, tables, lens = make_case(decodes, 1, 1, LATENT + ROPE, lengths, generator, ns.dtype)
        q_nope = torch.randn(decodes, heads, NOPE, generator=generator).to(ns.dtype)
        q_rope = torch.randn(decodes, heads, ROPE, generator=generator).to(ns.dtype)
        w_uk = (torch.randn(heads, NOPE, LATENT, generator=generator) / LATENT ** 0.5).to(ns.dtype)
        w_uv = (torch.randn(heads, LATENT, V_DIM, generator=generator) / LATENT ** 0.5).to(ns.dtype)
        starts = torch.arange(decodes + 1)
        plan = plan_cpu_attention([1] * decodes, starts.tolist(), lens.tolist(), tables, BLOCK_SIZE)
        rows = query  # this step's latent rows: already in the cache for the kernel; only their shape is read
        # the same blocks and lengths, each token's K and V per head
        shape = (cache.shape[0], BLOCK_SIZE, heads, NOPE + ROPE)
        k_cache, v_cache = (torch.randn(shape, generator=generator).to(ns.dtype) for _ in range(2))
        head_query = torch.randn(decodes, heads, NOPE + ROPE, generator=generator).to(ns.dtype)
        context = da.build_decode_context(lens, tables, BLOCK_SIZE, None)
        scale = (NOPE + ROPE) ** -0.5

        def latent():
            return latent_attention(reference, q_nope, q_rope, rows, w_uk, w_uv, cache, tables, starts, lens, scale,
                                    plan)

        def per_head():
            return da.decode_attention(head_query, k_cache, v_cache, scale, context)

        per_head_ms, latent_ms = time_ms(per_head, ns.repeat, loops=10), time_ms(latent, ns.repeat, loops=10)
        kv_bytes, latent_bytes = heads * (NOPE + ROPE + V_DIM) * element, (LATENT + ROPE) * element
        print(f"{name:<30}{per_head_ms:16.3f}{latent_ms:11.3f}{per_head_ms / latent_ms:7.1f}x{kv_bytes:18d}"
              f"{latent_bytes:8d}")

    prompts(ns)


def prompts(ns) -> None:
    generator = torch.Generator().manual_seed(1)
    print(f"\n{'one prompt chunk':<30}{'absorbed ms':>16}{'expanded ms':>12}{'ratio':>8}")
    for heads, tokens in PROMPTS:
        blocks = -(-tokens // BLOCK_SIZE)
        cache = torch.randn(blocks, BLOCK_SIZE, 1, LATENT + ROPE, generator=generator).to(ns.dtype)
        tables = torch.arange(blocks, dtype=torch.int32)[None]
        rows = cache.view(-1, 1, LATENT + ROPE)[:tokens]
        q_nope = torch.randn(tokens, heads, NOPE, generator=generator).to(ns.dtype)
        q_rope = torch.randn(tokens, heads, ROPE, generator=generator).to(ns.dtype)
        w_uk = (torch.randn(heads, NOPE, LATENT, generator=generator) / LATENT ** 0.5).to(ns.dtype)
        w_uv = (torch.randn(heads, LATENT, V_DIM, generator=generator) / LATENT ** 0.5).to(ns.dtype)
        starts, lens = torch.tensor([0, tokens]), torch.tensor([tokens], dtype=torch.int32)
        plan = plan_cpu_attention([tokens], [0, tokens], [tokens], tables, BLOCK_SIZE)
        scale = (NOPE + ROPE) ** -0.5

        def absorbed():
            query = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rope], dim=-1)
            out = attend(reference, query, rows, rows, cache, cache, tables, starts, lens, scale, None, plan)
            return torch.bmm(out[..., :LATENT].transpose(0, 1), w_uv)

        def expanded():
            return expanded_chunk(q_nope, q_rope, rows, cache, plan.chunks[0], w_uk, w_uv, scale)

        absorbed_ms, expanded_ms = time_ms(absorbed, ns.repeat, loops=2), time_ms(expanded, ns.repeat, loops=2)
        print(f"{f'{heads} heads, {tokens} tokens':<30}{absorbed_ms:16.1f}{expanded_ms:12.1f}"
              f"{absorbed_ms / expanded_ms:7.2f}x")


if __name__ == "__main__":
    main()
