"""One DeepSeek-V3 layer's decode attention on CPU: latent attention over the latent cache (queries
absorbing W_UK, then W_UV; worker_proc/latent_attention.py) against the same attention over a
per-head K/V cache (what the model's heads would keep expanded: K 192 dims, V 128 padded to 192 for
the one-head_dim kernel), both through the native decode kernel. Prints ms per layer call, median
of --repeat timed loops, and each cache's bytes per token and layer.

Heads: 16 (one rank of eight: DeepSeek-V3's 128 heads at --tensor-parallel-size 8) and 128.

    python bench/scripts/mla_decode_bench.py [--threads 1] [--repeat 5] [--dtype bfloat16]
"""

from __future__ import annotations

import torch

from cpu_attention_bench import BLOCK_SIZE, make_case, native_bench_args, time_ms
from pagedserve.kernels import reference
from pagedserve.worker_proc.attention import plan_cpu_attention
from pagedserve.worker_proc.latent_attention import latent_attention
from pagedserve.worker_proc import decode_attention as da

LATENT, ROPE, NOPE, V_DIM = 512, 64, 128, 128
# name, decodes, heads, context lengths (min, max)
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
        k_cache, v_cache = (torch.randn(cache.shape[0], BLOCK_SIZE, heads, NOPE + ROPE, generator=generator).to(ns.dtype)
                            for _ in range(2))
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


if __name__ == "__main__":
    main()
