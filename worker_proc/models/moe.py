"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): router, experts, shared expert.

A family file (mixtral.py, qwen_moe.py) reads its config into a ``MoeSpec`` with its checkpoint's
``ExpertNames`` (``ModelSpec.moe``) and gives ``MoeDecoderLayer`` as its layer class: the shared
DecoderLayer with this block as the MLP of the layers the spec marks sparse. The router is
replicated and computed with F.linear, as transformers does, so the experts picked are
transformers' (kernels/moe_routing.py routes). Each expert's intermediate features are sharded
across tensor-parallel ranks, as the dense MLP's are: every rank routes every token, runs its slice
of each chosen expert, and the layer's one all-reduce sums the block. With ``--enable-expert-parallel``
each rank holds whole experts instead, a tp-th of them (models/expert_parallel.py places them and
brings their tokens to them); the shared expert stays sliced.

How the experts run, chosen once at load and named in the worker log:

- CPU, bfloat16 on AVX512-BF16: one native call per layer for every active expert
  (kernels/cpu_moe.c through kernels/cpu_moe.py's ``NativeExperts``): the layer's experts packed once as
  stacked vdpbf16ps panels, the pairs sorted by expert inside the call, both cores streaming a share of
  every active expert's weights, the activation in registers, each output weighted and added into its
  token's row. One copy of the experts' bytes, for every row count: on Qwen3-30B-A3B's expert shape, one
  core's CPU time, it read the active experts at 88-91% of the core's read bandwidth at 1-16 tokens, 2.0-2.1x
  the per-expert path, 1.5x at 64 tokens, the same at 256 and 6% slower at 1024 (64 rows an expert), too
  little for a second copy of every expert (bench/scripts/moe_kernel_bench.py; docs/DECISIONS.md "One call
  for a layer's experts"). ``PAGEDSERVE_CPU_MOE_KERNEL=0`` keeps the per-expert path below; ``=1`` takes
  the kernel wherever the library is built (its widened forms on AVX-512 and AVX2: kernels/cpu_moe.py
  ``supports_native_experts``). Not covered, so per expert: float32 and float16 models, a model with
  ``--enable-lora`` (adapters add to each expert's products).
- CPU otherwise: the step's (token, expert) pairs sorted by expert, then one gate_up (with its SiLU gate)
  and one down matmul per *active* expert over its contiguous run of rows; an expert no token
  routes to costs nothing. Each expert is a pair of LinearWeights in the model's WeightLayout
  (models/linear.py), so the matmuls take the path dense layers take for the dtype and ISA:
  cpu_linear.c's panels (AVX2 without AVX-512), oneDNN's packed weights (bfloat16 on AVX512-BF16,
  float32 models past the caches), or torch's. Measured against a per-expert loop over plain
  weights and a dense loop over every expert: bench/scripts/moe_cpu_bench.py, bench/log/2026-12-06.md
  "CPU: mixture of experts". A model too large for two layouts of each matrix (models/linear.py keeps
  the weight as loaded beside cpu_gemv.c's panels there, twice its bytes) keeps its experts, nearly all
  of its bytes, in oneDNN's packed layout alone (``expert_layout``): issue 52's 15.5 GB Qwen3-MoE would
  not fit in 23 GiB twice, and per expert of Qwen3-30B-A3B's shape, read from DRAM, the packed call
  matched the panels at 1-2 rows and beat them and the row-major GEMV at 4-160 (bench/log/2026-12-07.md,
  "CPU: the Qwen3-MoE benchmark").
- GPU: kernels/fused_moe.py (Triton; vLLM's moe_align_block_size and grouped GEMM) over the
  experts stacked as [E, 2I, H] and [E, H, I]; the torch reference where the kernels are torch's.

gpt-oss adds biases to the router and to both expert projections, and its experts' clamped SwiGLU
(kernels/moe_reference.py ``ClampedSwiglu``; ``MoeSpec.activation``): on CPU its experts' gate_up is
a plain product (with its bias) and the activation torch ops; down's bias is added on rank 0 only,
so the ranks' sum holds it once. Its checkpoint's layout is its family's loader (``MoeSpec.read_experts``).

With ``--enable-lora`` a sparse layer's adapter slots (models/lora_experts.py ``MoeLayerLoRA``) hold the
routed experts' and the shared expert's adapters: ``grouped_experts`` adds each token's delta to the
products of the experts it is routed to; on a GPU a step with expert adapters takes the torch
reference (kernels/moe_reference.py, with the same deltas), as the Triton kernel adds none. With
LoRA, no expert's gate_up is packed for the fused SiLU gate (as a dense layer's: a delta joins gate
and up before the gate).

Checkpoints: the per-expert names the hub's checkpoints use and transformers 5's save_pretrained
writes (Mixtral ``block_sparse_moe.experts.N.w1/w3/w2``, Qwen ``mlp.experts.N.gate/up/down_proj``),
or transformers 5's in-memory fused names (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_moe, cpu_native, moe_reference
from pagedserve.kernels.moe_reference import ClampedSwiglu
from pagedserve.kernels.moe_routing import RoutingRule, route, sort_by_expert
from pagedserve.kernels.ops import select_ops
from pagedserve.worker_proc.elementwise import Elementwise
from pagedserve.worker_proc.env_switch import env_switch
from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError
from pagedserve.worker_proc.models.decoder_layer import DecoderLayer
from pagedserve.worker_proc.models.expert_parallel import ExpertPlacement
from pagedserve.worker_proc.models.linear import (LinearWeight, WeightLayout, linear, packed_linear_available,
                                                  silu_gate)
from pagedserve.worker_proc.models.lora_experts import (DOWN, GATE_UP, ExpertDeltas, ExpertLoRA, MoeLayerLoRA,
                                                        expert_rows, shared_expert_lora)
from pagedserve.worker_proc.models.lora_linear import LayerLoRA, LoRABatch, LoRAConfig
from pagedserve.worker_proc.rotary import RotaryEmbedding
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
from pagedserve.worker_proc.weights import WeightSource

log = logging.getLogger("pagedserve.worker")

MOE_KERNEL_ENV = "PAGEDSERVE_CPU_MOE_KERNEL"


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """Where a family's checkpoint keeps a sparse layer's tensors, under ``model.layers.{i}.``: the
    router ``{block}gate``, expert N's ``{block}experts.N.{gate|up|down}``, a shared expert
    ``{block}shared_expert.{gate_proj|up_proj|down_proj}`` and its gate ``{block}shared_expert_gate``."""
    block: str = "mlp."
    expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"  # gpt-oss: "router"


FUSED_BLOCK = "mlp."  # transformers 5's module names, where the experts are 3D tensors


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts family's experts (ModelSpec.moe), as its family file reads its config."""
    num_experts: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size
    routing: RoutingRule
    names: ExpertNames = ExpertNames()
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    activation: Optional[ClampedSwiglu] = None  # None: SiLU(gate) * up
    # transformers' gate_up parameter alternates gate and up outputs (gpt-oss): an adapter's B rows too
    gate_up_interleaved: bool = False
    # A family's own checkpoint layout (gpt-oss): (source, the layer's block prefix, this rank's
    # intermediate slice) -> per expert [2s, H] gate_up (gate rows first), [H, s] down, and their
    # biases ([2s] and [H]) or None. None: the per-expert or transformers' fused names below.
    read_experts: Optional[Callable[[WeightSource, str, tuple[int, int]], "ExpertTensors"]] = None

    def layer_params(self, hidden_size: int) -> int:
        """Weights of one sparse layer's MLP: every expert, the shared one, the routers."""
        experts = self.num_experts * 3 * hidden_size * self.expert_intermediate_size
        return experts + 3 * hidden_size * self.shared_expert_intermediate_size + (self.num_experts + 1) * hidden_size


@dataclass(frozen=True, slots=True)
class ExpertTensors:
    """One rank's slice of a layer's experts, as a family's ``read_experts`` returns them."""
    gate_ups: list[torch.Tensor]
    downs: list[torch.Tensor]
    gate_up_biases: Optional[list[torch.Tensor]] = None
    down_biases: Optional[list[torch.Tensor]] = None


def intermediate_part(size: int, shard: TensorParallelShard, what: str) -> tuple[int, int]:
    """This rank's [start, end) of ``size`` intermediate features (``what``: the config's name)."""
    if size % shard.size:
        raise UnsupportedModelError(f"tensor-parallel size {shard.size} does not divide {what}={size}; "
                                    "pick a tp_size that does")
    part = size // shard.size
    return shard.rank * part, (shard.rank + 1) * part


class SparseMoeBlock:
    def __init__(self, spec: ModelSpec, shard: TensorParallelShard, layer: int, source: WeightSource,
                 device: torch.device, dtype: torch.dtype, layout: WeightLayout = WeightLayout(),
                 lora: bool = False):
        """``lora``: adapters may add to the experts' products (no gate_up packed for the fused gate)."""
        moe = spec.moe
        self.rule, self.num_experts = moe.routing, moe.num_experts
        gate, up, down = moe.names.expert
        p = f"model.layers.{layer}.{moe.names.block}"
        if f"model.layers.{layer}.{FUSED_BLOCK}experts.gate_up_proj" in source:
            p, fused = f"model.layers.{layer}.{FUSED_BLOCK}", True
        else:
            fused = False

        def load(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        router = p + moe.names.router
        self.router = load(source.get(router + ".weight"))  # [E, H], on every rank
        self.router_bias = load(source.get(router + ".bias")) if moe.router_bias else None
        self.activation = moe.activation
        self.placement = ExpertPlacement.of(shard, moe.num_experts)
        if self.placement is None:  # every expert, a slice of each
            a, b = intermediate_part(moe.expert_intermediate_size, shard, "moe_intermediate_size")
            held = range(self.num_experts)
        else:  # whole experts, a tp-th of them
            a, b = 0, moe.expert_intermediate_size
            held = range(self.placement.first, self.placement.first + self.placement.count)
        size = b - a
        gate_up_biases = down_biases = None
        if moe.read_experts is not None:
            tensors = moe.read_experts(source, p, (a, b))
            gate_ups, downs = tensors.gate_ups[held.start: held.stop], tensors.downs[held.start: held.stop]
            if tensors.gate_up_biases is not None:
                gate_up_biases = tensors.gate_up_biases[held.start: held.stop]
            # sliced experts: the ranks' sum holds down's bias once; a whole expert keeps its own
            if tensors.down_biases is not None and (shard.rank == 0 or self.placement is not None):
                down_biases = tensors.down_biases[held.start: held.stop]
        elif fused:
            full_gate_up, full_down = source.get(p + "experts.gate_up_proj"), source.get(p + "experts.down_proj")
            inter = moe.expert_intermediate_size
            gate_ups = [torch.cat([w[a:b], w[inter + a: inter + b]]) for w in full_gate_up[held.start: held.stop]]
            downs = [w[:, a:b] for w in full_down[held.start: held.stop]]
        else:
            e = p + "experts.{}.{}.weight"
            gate_ups = [torch.cat([source.get(e.format(i, gate), dim=0, part=(a, b)),
                                   source.get(e.format(i, up), dim=0, part=(a, b))]) for i in held]
            downs = [source.get(e.format(i, down), dim=1, part=(a, b)) for i in held]
        no_biases = [None] * len(held)
        self.native: Optional[cpu_moe.NativeExperts] = None
        if device.type == "cpu" and native_experts_chosen(dtype, lora):
            self.native = cpu_moe.NativeExperts([load(w) for w in gate_ups], [load(w) for w in downs],
                                                gate_up_biases and [load(b) for b in gate_up_biases],
                                                down_biases and [load(b) for b in down_biases], self.activation)
            self.experts = self.gate_up = self.down = self.gate_up_bias = self.down_bias = None
            self.kernel = f"one native call per layer (kernels/cpu_moe.c, {cpu_native.kernel_variant()})"
        elif device.type == "cpu":
            layout = expert_layout(layout, dtype)
            # A clamped SwiGLU multiplies through linear(): no panels interleaved for silu_gate. Nor with LoRA
            # where the native panels would interleave them.
            gate_size = 0 if self.activation is not None or (lora and layout.native) else size
            self.experts = [(LinearWeight.of(load(gu), load(gub), layout, gate_size=gate_size),
                             LinearWeight.of(load(d), load(db), layout))
                            for gu, d, gub, db in zip(gate_ups, downs, gate_up_biases or no_biases,
                                                      down_biases or no_biases)]
            self.gate_up = self.down = self.gate_up_bias = self.down_bias = None
            self.kernel = "grouped by expert: " + _layout_name(self.experts[0][0])
        else:
            self.experts = None
            self.gate_up, self.down = load(torch.stack(gate_ups)), load(torch.stack(downs))
            self.gate_up_bias = None if gate_up_biases is None else load(torch.stack(gate_up_biases))
            self.down_bias = None if down_biases is None else load(torch.stack(down_biases))
            self.fused_moe = moe_reference.fused_moe
            self.kernel = "torch reference (per-expert loop)"
            if select_ops(device).__name__.endswith("triton_ops"):
                from pagedserve.kernels import fused_moe  # imports triton

                self.fused_moe = fused_moe.fused_moe
                self.kernel = "Triton fused_moe (sorted token blocks, grouped GEMM)"
        del gate_ups, downs
        self.shared: Optional[tuple[LinearWeight, LinearWeight, torch.Tensor]] = None
        if moe.shared_expert_intermediate_size:  # Qwen2-MoE's, under the same names in either form
            sa, sb = intermediate_part(moe.shared_expert_intermediate_size, shard, "shared_expert_intermediate_size")
            shared = p + "shared_expert."
            shared_gate_up = load(torch.cat([source.get(shared + "gate_proj.weight", dim=0, part=(sa, sb)),
                                             source.get(shared + "up_proj.weight", dim=0, part=(sa, sb))]))
            shared_down = load(source.get(shared + "down_proj.weight", dim=1, part=(sa, sb)))
            shared_gate = 0 if lora and layout.native else sb - sa
            self.shared = (LinearWeight.of(shared_gate_up, None, layout, gate_size=shared_gate),
                           LinearWeight.of(shared_down, None, layout),
                           load(source.get(p + "shared_expert_gate.weight")))  # [1, H], on every rank
        if layer == spec.moe.sparse_layers.index(True):
            log.info("mixture of experts: %d experts, top %d; %s", self.num_experts, self.rule.top_k, self.kernel)
            if shard.expert_parallel:
                log.info("%s", "expert parallel: one rank holds every expert" if self.placement is None
                         else self.placement.describe())

    def forward(self, x: torch.Tensor, ew: Elementwise, lora: Optional[LoRABatch] = None,
                slots: Optional[MoeLayerLoRA] = None, ops: Optional[ModuleType] = None) -> torch.Tensor:
        """x [T, H] (after the norm before the MLP) -> this rank's part of the block's output [T, H]:
        the decoder layer sums the ranks' parts, as it does the dense MLP's. ``lora``: the step's adapter
        tokens, ``slots`` this layer's adapter weights (or None)."""
        deltas = slots.experts.deltas(lora) if slots is not None and slots.experts is not None else None
        out = self._routed(x, ew, deltas)
        if self.shared is not None:
            gate_up, down, gate = self.shared
            out = out + torch.sigmoid(F.linear(x, gate)) * self._shared(x, gate_up, down, ew, lora, slots, ops)
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids [T, top_k] (DeepSeek's block has its own router)."""
        return route(F.linear(x, self.router, self.router_bias), self.rule)

    def _routed(self, x: torch.Tensor, ew: Elementwise, deltas: Optional[ExpertDeltas] = None) -> torch.Tensor:
        """This rank's part of the routed experts' output [T, H]."""
        if self.placement is not None:  # adapters on placed experts are refused at start (ModelRunner)
            return self.placement.routed_output(x, self._route, lambda rows, counts: self._rows(rows, counts, ew))
        weights, ids = self._route(x)
        if self.native is not None:
            return self.native(x, weights, ids)
        if self.experts is not None:
            return grouped_experts(x, self.experts, weights, ids, ew, self.activation, deltas)
        if deltas is not None:  # the Triton kernel adds no adapter: the reference loop does
            return moe_reference.fused_moe(x, self.gate_up, self.down, weights, ids, self.gate_up_bias,
                                           self.down_bias, self.activation, deltas)
        return self.fused_moe(x, self.gate_up, self.down, weights, ids, self.gate_up_bias, self.down_bias,
                              self.activation)

    def _rows(self, rows: torch.Tensor, counts: list[int], ew: Elementwise) -> torch.Tensor:
        """Each row's output of its expert, unweighted: ``rows`` sorted by this rank's expert, ``counts``
        rows each (expert parallelism's exchange)."""
        if self.native is not None:
            return self.native.rows(rows, counts)
        if self.experts is not None:
            return expert_runs(rows, counts, self.experts, ew, self.activation)
        ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                      torch.tensor(counts, device=rows.device))[:, None]
        unweighted = torch.ones(ids.shape, dtype=rows.dtype, device=rows.device)
        return self.fused_moe(rows, self.gate_up, self.down, unweighted, ids, self.gate_up_bias, self.down_bias,
                              self.activation)

    @staticmethod
    def _shared(x: torch.Tensor, gate_up: LinearWeight, down: LinearWeight, ew: Elementwise,
                lora: Optional[LoRABatch], slots: Optional[MoeLayerLoRA], ops: Optional[ModuleType]) -> torch.Tensor:
        """The shared expert's output before its gate, with its adapter deltas as a dense MLP's."""
        adapted = lora is not None and slots is not None and slots.gate_up is not None
        if not adapted and gate_up.gate_size:
            return linear(silu_gate(x, gate_up, ew), down)
        products = linear(x, gate_up)
        if adapted:
            slots.gate_up.add_delta(x, products, lora, ops)
        hidden = ew.silu_mul(products, products.shape[1] // 2)
        out = linear(hidden, down)
        return slots.down.add_delta(hidden, out, lora, ops) if adapted else out


class MoeDecoderLayer(DecoderLayer):
    """A mixture-of-experts family's layer (its ``Family(layer=...)``): the shared DecoderLayer, whose MLP
    in the layers its ``MoeSpec`` marks sparse is the experts' block; the other layers keep the dense MLP."""

    def __init__(self, spec: ModelSpec, shard: TensorParallelShard, layer: int, source: WeightSource,
                 device: torch.device, dtype: torch.dtype, layout: WeightLayout = WeightLayout(),
                 rotary: Optional[RotaryEmbedding] = None, lora: Optional[LoRAConfig] = None):
        sparse = spec.moe.sparse_layers[layer]
        super().__init__(spec, shard, layer, source, device, dtype, layout, rotary, dense_mlp=not sparse, lora=lora)
        self.moe = (SparseMoeBlock(spec, shard, layer, source, device, dtype, layout, lora is not None)
                    if sparse else None)
        if sparse and lora is not None:
            self.lora = _sparse_layer_lora(self.lora, spec, shard, lora, dtype, device)

    def _mlp(self, x: torch.Tensor, ew: Elementwise, lora: Optional[LoRABatch] = None,
             ops: Optional[ModuleType] = None) -> torch.Tensor:
        if self.moe is None:
            return super()._mlp(x, ew, lora, ops)
        return self.moe.forward(x, ew, lora, self.lora, ops)


def _sparse_layer_lora(dense: LayerLoRA, spec: ModelSpec, shard: TensorParallelShard, config: LoRAConfig,
                       dtype: torch.dtype, device: torch.device) -> MoeLayerLoRA:
    """A sparse layer's slots: attention's (the shared layer's), the shared expert's, the routed experts'."""
    moe = spec.moe
    a, b = intermediate_part(moe.expert_intermediate_size, shard, "moe_intermediate_size")
    experts = ExpertLoRA(moe.num_experts, spec.hidden_size, b - a, config, dtype, device)
    gate_up = down = None
    if moe.shared_expert_intermediate_size:
        sa, sb = intermediate_part(moe.shared_expert_intermediate_size, shard, "shared_expert_intermediate_size")
        gate_up, down = shared_expert_lora(spec.hidden_size, sb - sa, config, dtype, device)
    return MoeLayerLoRA(dense.qkv, dense.o, gate_up, down, experts)


def moe_rank_parts(moe: MoeSpec, shard: TensorParallelShard) -> tuple[Callable[[str], list[tuple[int, int]]],
                                                                      Callable[[str], torch.Tensor]]:
    """How this rank cuts an adapter of a mixture of experts (worker_proc/lora_adapters.py's AdapterReader):
    a shared expert module's intermediate range, and a routed expert module's rows (lora_experts.expert_rows)."""
    def shared_parts(module: str) -> list[tuple[int, int]]:
        return [intermediate_part(moe.shared_expert_intermediate_size, shard, "shared_expert_intermediate_size")]

    def rows(module: str) -> torch.Tensor:
        part = intermediate_part(moe.expert_intermediate_size, shard, "moe_intermediate_size")
        return expert_rows(module, part, moe.expert_intermediate_size, moe.gate_up_interleaved)
    return shared_parts, rows


def grouped_experts(x: torch.Tensor, experts: list[tuple[LinearWeight, LinearWeight]], weights: torch.Tensor,
                    ids: torch.Tensor, ew: Elementwise, activation: Optional[ClampedSwiglu] = None,
                    deltas: Optional[ExpertDeltas] = None) -> torch.Tensor:
    """moe_reference.fused_moe's result from per-expert LinearWeights: the pairs sorted by expert,
    one silu_gate and one linear per active expert over its rows, each output row scaled by its
    weight (in the weight's dtype, then rounded to x's, as transformers does) and added into its
    token's row, a token's experts in ascending order. ``activation``: gpt-oss's clamped SwiGLU
    on gate_up's product (with its bias) in place of silu_gate. ``deltas``: adapters' deltas added
    to each expert's two products (models/lora_experts.py)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    order = sort_by_expert(ids, len(experts))
    masks = None if deltas is None else deltas.masks(order.token_of, order.counts)
    outputs = expert_runs(x[order.token_of], order.counts, experts, ew, activation, deltas, masks)
    scaled = (outputs * weights.reshape(-1)[order.pair, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order.token_of, scaled)


def expert_runs(rows: torch.Tensor, counts: list[int], experts: list[tuple[LinearWeight, LinearWeight]],
                ew: Elementwise, activation: Optional[ClampedSwiglu] = None, deltas: Optional[ExpertDeltas] = None,
                masks: Optional[list] = None) -> torch.Tensor:
    """Each row's output of its expert, unweighted [P, H]: ``rows`` sorted by expert, ``counts[e]`` of
    expert e's; one silu_gate (or gate_up and the activation) and one down per active expert.
    ``masks``: ``deltas.masks`` of the rows, where adapters add to the products."""
    outs = []
    start = 0
    masks = [None] * len(experts) if masks is None else masks
    for expert, ((gate_up, down), count, mask) in enumerate(zip(experts, counts, masks)):
        if count:
            own = rows[start: start + count]
            size = gate_up.out_features // 2
            if mask is None and activation is None and gate_up.gate_size:
                hidden = silu_gate(own, gate_up, ew)
            else:
                products = linear(own, gate_up)
                if mask is not None:
                    deltas.add(GATE_UP, expert, own, products, mask)
                hidden = (ew.silu_mul(products, size) if activation is None
                          else moe_reference.gated(products, size, activation))
            out = linear(hidden, down)
            if mask is not None:
                deltas.add(DOWN, expert, hidden, out, mask)
            outs.append(out)
            start += count
    return torch.cat(outs) if outs else rows.new_zeros(0, rows.shape[1])


def native_experts_chosen(dtype: torch.dtype, lora: bool) -> bool:
    """Whether a CPU model's routed experts take kernels/cpu_moe.c: bfloat16 without adapters, where it
    multiplies by vdpbf16ps (``PAGEDSERVE_CPU_MOE_KERNEL``: 0 never, 1 wherever the library is built)."""
    choice = env_switch(MOE_KERNEL_ENV)
    if dtype != torch.bfloat16 or lora or choice is False or cpu_native.library() is None:
        return False
    return choice is True or cpu_moe.supports_native_experts()


def expert_layout(layout: WeightLayout, dtype: torch.dtype) -> WeightLayout:
    """The routed experts' layout on CPU: the model's, but oneDNN's packed weight alone where the model keeps
    cpu_gemv.c's layouts without a packed copy (too large for two: the weight as loaded beside the panels is
    already two) and oneDNN computes the dtype: one copy of the experts' bytes, and the faster per expert
    (module docstring)."""
    if layout.gemv and not layout.packed and packed_linear_available(dtype):
        return WeightLayout(packed=True, plain=False)
    return layout


def _layout_name(w: LinearWeight) -> str:
    if w.panels is not None:
        return f"native matmuls ({str(w.panels.dtype).removeprefix('torch.')} panels)"
    if w.packed is not None:
        return "oneDNN packed matmuls"
    return "torch matmuls" + (" ([in, out] copies)" if w.weight_t is not None else "")
