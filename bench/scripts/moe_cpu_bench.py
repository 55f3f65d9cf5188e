"""One mixture-of-experts layer's experts on CPU, four ways, per token count (ms: the fastest of
--repeat calls; ``--clock cpu`` times one thread's CPU time instead of the wall clock, which a
machine shared with other work's runnable threads cannot stretch by preempting the call):

- grouped: worker_proc/models/moe.py's path, the pairs sorted by expert and one silu_gate + linear
  per active expert, each expert in the weight layout the dense layers would take for this model's
  size and dtype (models/linear.py weight_layout: native panels, oneDNN packed, or torch's);
- grouped-torch: the same grouping over plain [out, in] weights and F.linear (what the layout adds);
- naive loop: transformers' eager experts loop (kernels/moe_reference.py): every expert asked which
  tokens it has, F.linear on plain weights;
- dense: every expert over every token, its output weighted by the routing (0 where not routed);
- with ``--lora-slots K``, grouped + LoRA: the grouped path with K adapters of ``--lora-rank`` on both
  expert parameters (models/lora_experts.py), the tokens spread over the K slots.

    python bench/scripts/moe_cpu_bench.py [--shape qwen3-moe|mixtral] [--dtype float32|bfloat16]
        [--tokens 1,2,4,8,16,256] [--threads 2 | --clock cpu] [--lora-slots 4 --lora-rank 16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedserve.kernels import moe_reference
from pagedserve.kernels.moe_routing import RoutingRule, route
from pagedserve.worker_proc.elementwise import TorchElementwise
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout, weight_layout
from pagedserve.worker_proc.models.lora_experts import ExpertLoRA
from pagedserve.worker_proc.models.lora_linear import LoRABatch, LoRAConfig
from pagedserve.worker_proc.models.moe import _layout_name, grouped_experts

import time

from step_phases import timed_runs

# name: (hidden, expert intermediate, experts, top_k). Qwen3-30B-A3B's layer with a quarter of its 128
# experts (memory); Mixtral 8x7B's routing at a quarter of its width.
SHAPES = {"qwen3-moe": (2048, 768, 32, 8), "mixtral": (1024, 3584, 8, 2)}


def dense_experts(x, gate_up, down, weights, ids):
    dense_weights = torch.zeros(x.shape[0], gate_up.shape[0], dtype=weights.dtype).scatter_(1, ids, weights)
    size = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        gate, up = F.linear(x, gate_up[e]).split(size, dim=-1)
        out += (F.linear(F.silu(gate) * up, down[e]) * dense_weights[:, e, None]).to(x.dtype)
    return out


def expert_adapters(num_experts: int, hidden: int, size: int, slots: int, rank: int, dtype: torch.dtype,
                    g: torch.Generator) -> ExpertLoRA:
    """``slots`` random adapters of ``rank`` on both expert parameters, loaded as the worker loads them."""
    lora = ExpertLoRA(num_experts, hidden, size, LoRAConfig(max_loras=slots, max_rank=rank), dtype,
                      torch.device("cpu"))
    for slot in range(slots):
        lora.load(slot, {"experts.gate_up_proj": (torch.randn(num_experts, rank, hidden, generator=g).to(dtype),
                                                  torch.randn(num_experts, 2 * size, rank, generator=g).to(dtype)),
                         "experts.down_proj": (torch.randn(num_experts, rank, size, generator=g).to(dtype),
                                               torch.randn(num_experts, hidden, rank, generator=g).to(dtype))})
    return lora


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tokens", default="1,2,4,8,16,256")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: one thread's CPU time")
    p.add_argument("--lora-slots", type=int, default=0, help="a column with this many expert adapters (0: none)")
    p.add_argument("--lora-rank", type=int, default=16)
    ns = p.parse_args()
    if ns.clock == "cpu":
        ns.threads = 1
    if ns.threads:
        torch.set_num_threads(ns.threads)
    dtype = getattr(torch, ns.dtype)
    hidden, size, num_experts, top_k = SHAPES[ns.shape]
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(num_experts, 2 * size, hidden, generator=g) * 0.02).to(dtype)
    down = (torch.randn(num_experts, hidden, size, generator=g) * 0.02).to(dtype)
    # the layout a model whose 48 layers hold these experts would get
    layout = weight_layout(torch.device("cpu"), 48 * gate_up.numel() * 3 // 2 * gate_up.element_size(), dtype)
    grouped = [(LinearWeight.of(gate_up[e], None, layout, gate_size=size), LinearWeight.of(down[e], None, layout))
               for e in range(num_experts)]
    plain = [(LinearWeight.of(gate_up[e], None, WeightLayout(), gate_size=size),
              LinearWeight.of(down[e], None, WeightLayout())) for e in range(num_experts)]
    ew = TorchElementwise()
    lora = (expert_adapters(num_experts, hidden, size, ns.lora_slots, ns.lora_rank, dtype, g)
            if ns.lora_slots else None)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, {ns.clock} clock; "
          f"{ns.shape} H={hidden} I={size} E={num_experts} top-{top_k}, {ns.dtype}; "
          f"grouped layout: {_layout_name(grouped[0][0])}")
    with_lora = f" grouped + LoRA ({ns.lora_slots} slots, rank {ns.lora_rank}) |" if lora else ""
    print(f"| tokens | active experts | grouped | grouped-torch | naive loop | dense |{with_lora} fastest of the four |")
    print("|---|---|---|---|---|---|---|" + ("---|" if lora else ""))
    for tokens in (int(t) for t in ns.tokens.split(",")):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        weights, ids = route(torch.randn(tokens, num_experts, generator=g).to(dtype), RoutingRule(top_k, True))
        calls = {"grouped": lambda: grouped_experts(x, grouped, weights, ids, ew),
                 "grouped-torch": lambda: grouped_experts(x, plain, weights, ids, ew),
                 "naive loop": lambda: moe_reference.fused_moe(x, gate_up, down, weights, ids),
                 "dense": lambda: dense_experts(x, gate_up, down, weights, ids)}
        if lora is not None:
            batch = LoRABatch.build(torch.arange(tokens) % ns.lora_slots, torch.device("cpu"), ns.lora_slots,
                                    ns.lora_rank, dtype, (ns.lora_rank,) * ns.lora_slots, path="segments")
            calls["grouped + LoRA"] = lambda: grouped_experts(x, grouped, weights, ids, ew, deltas=lora.deltas(batch))
        repeat = ns.repeat if tokens <= 16 else max(3, ns.repeat // 3)
        clock = time.thread_time if ns.clock == "cpu" else time.perf_counter
        times = {k: min(timed_runs(c, repeat, warmup=2, clock=clock)) for k, c in calls.items()}
        cells = " | ".join(f"{1e3 * t:.2f}" for t in times.values())
        fastest = min((k for k in times if k != "grouped + LoRA"), key=times.get)
        print(f"| {tokens} | {len(ids.unique())} | {cells} | {fastest} |", flush=True)


if __name__ == "__main__":
    main()
