"""LoRA's CPU delta paths (worker_proc/models/lora_linear.py) on one 0.5B layer, per token count: the
native grouped kernel (kernels/cpu_lora.c), the dense masked matmuls over every slot and one matmul
pair per adapter segment, beside the
layer's base projections (F.linear) for scale. Every slot holds an adapter on all seven projections;
a step's tokens are spread over the slots in turn (decodes: each token its own request) or, with
``--runs``, as one run of tokens per slot (prompt chunks). Prints ms per ``--layers`` layers (median of --repeat).
``DENSE_MAX_TOKENS`` is the crossover this measures (where the native library is not built).

    python bench/scripts/lora_paths_bench.py [--tokens 1,4,8,16,32,64,128,256] [--dtype bfloat16] [--slots 8]
    python bench/scripts/lora_paths_bench.py --layers 24 --threads 1 --tokens 8,32,256    # a step's deltas, cold

``--layers N`` times N layers' deltas one after another (N = 24: a 0.5B step's, 141 MB of weights at 8 slots: past
the caches, as in a step); ``--threads 1`` times by the thread's CPU time, which other work cannot stretch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from pagedserve.worker_proc.models.lora_linear import LoRABatch, LoRAConfig, layer_lora

from step_phases import timed_runs

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 896, 4864, 14, 2, 64
MODULES = {"q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
           "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
           "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runs", action="store_true", help="tokens as one run per slot (prompt chunks)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--layers", type=int, default=1, help="layers' weights timed one after another (24: cold)")
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    dtype = getattr(torch, ns.dtype)
    torch.manual_seed(0)
    config = LoRAConfig(ns.slots, ns.rank)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    layers = [layer_lora(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                         "self_attn.o_proj", "mlp.down_proj", HIDDEN, q, kv, INTER, config, dtype, torch.device("cpu"))
              for _ in range(ns.layers)]
    for layer in layers:
        for slot in range(ns.slots):
            for projection in layer.projections:
                projection.load(slot, {name: (torch.randn(ns.rank, MODULES[name][0], dtype=dtype) * 0.05,
                                              torch.randn(MODULES[name][1], ns.rank, dtype=dtype) * 0.05)
                                       for name in projection.names})
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    base = {"qkv": torch.randn(q + 2 * kv, HIDDEN, dtype=dtype), "o": torch.randn(HIDDEN, q, dtype=dtype),
            "gate_up": torch.randn(2 * INTER, HIDDEN, dtype=dtype), "down": torch.randn(HIDDEN, INTER, dtype=dtype)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {ns.dtype}, {ns.slots} slots of rank "
          f"{ns.rank}, tokens {'in one run per slot' if ns.runs else 'spread over the slots in turn'}; ms for "
          f"{ns.layers} layer(s), {'thread CPU' if clock is time.thread_time else 'wall'} time")
    paths = ("native", "dense", "segments") if cpu_native.supports_lora() else ("dense", "segments")
    print("| tokens | base projections ms | " + " | ".join(f"{p} ms (/ base)" for p in paths) + " |")
    print("|---|---|" + "---|" * len(paths))
    for tokens in map(int, ns.tokens.split(",")):
        if ns.runs:
            slots = torch.arange(tokens) * ns.slots // tokens
        else:
            slots = torch.arange(tokens) % ns.slots
        xs = {"qkv": torch.randn(tokens, HIDDEN, dtype=dtype), "o": torch.randn(tokens, q, dtype=dtype),
              "gate_up": torch.randn(tokens, HIDDEN, dtype=dtype), "down": torch.randn(tokens, INTER, dtype=dtype)}
        outs = {name: F.linear(xs[name], w) for name, w in base.items()}
        ranks = (ns.rank,) * ns.slots

        def base_step():
            for _ in layers:
                for name, w in base.items():
                    F.linear(xs[name], w)

        b = 1e3 * statistics.median(timed_runs(base_step, ns.repeat, warmup=2, clock=clock))
        cells = []
        for path in paths:
            # built once per step (every layer shares it): outside the timed layer
            batch = LoRABatch.build(slots, torch.device("cpu"), ns.slots, ns.rank, dtype, ranks, path)

            def step():
                for layer in layers:
                    for name in ("qkv", "o", "gate_up", "down"):
                        getattr(layer, name).add_delta(xs[name], outs[name], batch)

            ms = 1e3 * statistics.median(timed_runs(step, ns.repeat, warmup=2, clock=clock))
            cells.append(f"{ms:.3f} ({ms / b:.2f})")
        print(f"| {tokens} | {b:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
