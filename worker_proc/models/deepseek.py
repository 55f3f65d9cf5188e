"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) over a latent paged cache, and a
mixture of experts with shared experts and grouped top-k routing.

Attention. Each token's keys and values are compressed into one latent row: ``kv_a_proj_with_mqa``
gives kv_lora_rank dims (then ``kv_a_layernorm``) and qk_rope_head_dim dims that are rotated and
shared by every head. The paged cache keeps only that row, kv_lora_rank + qk_rope_head_dim per
token and layer (kv_cache.py ``KVCacheSpec.latent``: one kind, one head, the same on every rank),
not per-head K and V: DeepSeek-V3 keeps 576 numbers a token where 128 heads' K (192) and V (128) are 40960.

Queries absorb the key up-projection, as DeepSeek's paper describes: ``kv_b_proj`` holds per head
W_UK [qk_nope, L] and W_UV [v_head, L], and q_nope . (W_UK c) = (q_nope W_UK) . c, so each head's
query becomes (q_nope W_UK, q_rope) over the latent rows (c, k_rope): multi-query attention with
one "KV head" of width L + R, keys and values both read from the latent (the value is its first L
dims; the shared CPU kernels read the whole row as V and drop its last R output dims, R / (L + R) = 11%
more value arithmetic than a V-only read). The attention output per head then goes through W_UV and
o_proj. Decodes take this form (worker_proc/latent_attention.py): on CPU through the native decode
kernel every family uses, on Triton ops through kernels/mla_attention.py (prompts too). Prompt chunks
on CPU are expanded instead, as transformers computes them (each head's K and V made from the visible
latent rows, SDPA): a score is then a qk_nope + R product rather than an L + R one, 1.3-1.8x faster
(bench/scripts/mla_attention_bench.py). Either way a step writes only the latent rows.

Rotary embedding on the qk_rope_head_dim part: V2 multiplies complex pairs (``apply_rotary_emb``:
interleaved (x0, x1), (x2, x3) ...), done here with the same complex ops; V3 with ``rope_interleave``
(its default) takes the even then the odd dims and rotates them as halves, exactly what the shared
rotary computes after that reordering (queries and keys alike, so scores are unchanged); without it,
the shared rotary as is. YaRN's mscale: transformers folds ``mscale_all_dim`` into the softmax scale
(``yarn_apply_mscale``), and its attention factor into cos/sin (the shared tables).

Mixture of experts (models/moe.py's block, grouped by expert on CPU, Triton fused_moe on GPU): the
first ``first_k_dense_replace`` layers have a dense MLP of intermediate_size, the others
``n_routed_experts`` experts routed by kernels/moe_routing.py's ``GroupedRouting`` (float32 router,
kept in float32 as transformers keeps it) plus ``n_shared_experts`` experts fused as one MLP of
moe_intermediate_size x n_shared_experts that every token passes through unweighted.

Tensor parallelism: heads split (q / q_b_proj and kv_b_proj by rows, o_proj by columns); q_a_proj,
kv_a_proj_with_mqa and their norms are replicated, and every rank keeps the whole latent cache;
dense and expert MLPs split their intermediate features as the other families do.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedserve.kernels.moe_routing import GroupedRouting
from pagedserve.worker_proc.elementwise import Elementwise
from pagedserve.worker_proc.input_batch import ForwardBatch, OutputRows
from pagedserve.worker_proc.latent_attention import latent_attention
from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError
from pagedserve.worker_proc.models.decoder_layer import DecoderLayer
from pagedserve.worker_proc.models.family import Family, LayerNames
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout, linear, silu_gate
from pagedserve.worker_proc.models.lora_linear import LoRABatch, LoRAConfig
from pagedserve.worker_proc.models.moe import MoeSpec, SparseMoeBlock, intermediate_part
from pagedserve.worker_proc.rotary import RotaryEmbedding
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
from pagedserve.worker_proc.weights import WeightSource

log = logging.getLogger("pagedserve.worker")

# The latent projections' own norms: transformers builds them with RMSNorm's default eps, not the config's.
LATENT_NORM_EPS = 1e-6
ROPE_COMPLEX, ROPE_INTERLEAVED, ROPE_HALVES = "complex", "interleaved", "halves"


def _routing(config: Any, v3: bool) -> GroupedRouting:
    """The router's rule; protocol/model_architectures.py has refused groups that contradict themselves."""
    grouped = v3 or config.topk_method == "group_limited_greedy"
    groups, topk_groups = (config.n_group or 1, config.topk_group or 1) if grouped else (1, 1)
    return GroupedRouting(config.num_experts_per_tok, sigmoid=v3, num_groups=groups, topk_groups=topk_groups,
                          group_score_top=2 if v3 else 1, renormalize=v3 and bool(config.norm_topk_prob),
                          scaling=float(config.routed_scaling_factor))


def _read_config(config: Any, v3: bool) -> dict:
    from transformers.modeling_rope_utils import yarn_apply_mscale

    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise UnsupportedModelError(f"config.json: {flag}=true is not supported for DeepSeek")
    if config.hidden_act != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act {config.hidden_act!r} is not supported for DeepSeek "
                                    "(silu)")
    layers = config.num_hidden_layers
    experts = config.n_routed_experts or 0
    sparse = tuple(experts > 0 and i >= (config.first_k_dense_replace or 0) for i in range(layers))
    moe = None
    if any(sparse):
        moe = MoeSpec(experts, config.moe_intermediate_size, 0, sparse, _routing(config, v3))
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    hidden, heads, latent = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    q_rank = config.q_lora_rank
    queries = hidden * heads * qk_head_dim if q_rank is None else q_rank * (hidden + heads * qk_head_dim)
    attention = (queries + hidden * (latent + config.qk_rope_head_dim)
                 + latent * heads * (config.qk_nope_head_dim + config.v_head_dim) + heads * config.v_head_dim * hidden)
    return dict(num_kv_heads=1, moe=moe, latent_cache_dim=latent + config.qk_rope_head_dim, attention_params=attention,
                attention_scale=yarn_apply_mscale(config.rope_parameters, qk_head_dim ** -0.5))


def _rope_form(config: Any, v3: bool) -> str:
    if not v3:
        return ROPE_COMPLEX
    return ROPE_INTERLEAVED if getattr(config, "rope_interleave", True) else ROPE_HALVES


class DeepseekMoeBlock(SparseMoeBlock):
    """models/moe.py's experts with DeepSeek's router (float32, ``gate.e_score_correction_bias`` in V3)
    and its shared experts (``mlp.shared_experts.*``, no gate)."""

    def __init__(self, spec: ModelSpec, shard: TensorParallelShard, layer: int, source: WeightSource,
                 device: torch.device, dtype: torch.dtype, layout: WeightLayout = WeightLayout()):
        super().__init__(spec, shard, layer, source, device, dtype, layout)
        p = f"model.layers.{layer}.mlp."
        self.router = source.get(p + "gate.weight").to(device, torch.float32).contiguous()
        self.correction_bias = (source.get(p + "gate.e_score_correction_bias").to(device, torch.float32)
                                if self.rule.sigmoid else None)
        config = spec.hf_config
        shared = config.moe_intermediate_size * (config.n_shared_experts or 0)
        self.shared_experts: Optional[tuple[LinearWeight, LinearWeight]] = None
        if shared:
            a, b = intermediate_part(shared, shard, "moe_intermediate_size * n_shared_experts")
            s = p + "shared_experts."
            gate_up = torch.cat([source.get(s + "gate_proj.weight", dim=0, part=(a, b)),
                                 source.get(s + "up_proj.weight", dim=0, part=(a, b))])
            self.shared_experts = (LinearWeight.of(gate_up.to(device, dtype).contiguous(), None, layout,
                                                   gate_size=b - a),
                                   LinearWeight.of(source.get(s + "down_proj.weight", dim=1, part=(a, b))
                                                   .to(device, dtype).contiguous(), None, layout))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rule.route(F.linear(x.float(), self.router), self.correction_bias)

    def forward(self, x: torch.Tensor, ew: Elementwise) -> torch.Tensor:
        """This rank's part of routed + shared experts (DeepseekV3MoE.forward's sum, in its order)."""
        out = self._routed(x, ew)
        if self.shared_experts is not None:
            gate_up, down = self.shared_experts
            out = out + linear(silu_gate(x, gate_up, ew), down)
        return out


class MlaDecoderLayer(DecoderLayer):
    """One DeepSeek layer: latent attention (above), then a dense MLP or the experts. The shared
    layer's norms, residual joins, all-reduce and dense MLP (``_join``, ``_finish``, ``_mlp``) are
    reused; its attention weights are not loaded."""

    def __init__(self, spec: ModelSpec, shard: TensorParallelShard, layer: int, source: WeightSource,
                 device: torch.device, dtype: torch.dtype, layout: WeightLayout = WeightLayout(),
                 rotary: Optional[RotaryEmbedding] = None, lora: Optional[LoRAConfig] = None):
        if lora is not None:
            raise UnsupportedModelError(f"{spec.architecture}: LoRA adapters are not supported on latent attention")
        if getattr(source, "quantization", None) is not None:
            raise UnsupportedModelError(f"{spec.architecture}: quantized checkpoints are not supported")
        c = spec.hf_config
        p = f"model.layers.{layer}."
        self.eps, self.shard, self.rotary = spec.rms_norm_eps, shard, rotary
        self.residual_scale, self.lora, self.gelu = 1.0, None, False
        self.o_bias = self.down_bias = self.post_attention_norm = self.post_mlp_norm = None
        self.num_heads, self.scale = shard.num_heads, spec.attention_scale
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.latent = c.kv_lora_rank
        self.rope_form = _rope_form(c, spec.architecture == "DeepseekV3ForCausalLM")
        # V2's complex rotation computes its angles per step, as transformers does: its frequencies on the
        # device (a host copy inside a captured CUDA graph is not allowed)
        self.inv_freq = None if rotary is None else rotary.inv_freq.to(device)

        def load(name: str, dim: int = 0, part: Optional[tuple[int, int]] = None) -> torch.Tensor:
            return source.get(p + name, dim=dim, part=part).to(device, dtype).contiguous()

        def weight(name: str, dim: int = 0, part: Optional[tuple[int, int]] = None) -> LinearWeight:
            return LinearWeight.of(load(name + ".weight", dim, part), None, layout)

        self.pre_attention_norm = load("input_layernorm.weight")
        self.pre_mlp_norm = load("post_attention_layernorm.weight")
        heads = shard.head_rows(self.nope + self.rope)
        # q_a and kv_a read the same input: one matmul ([q_a; kv_a] rows, replicated)
        if c.q_lora_rank is None:
            self.q_a_norm = None
            self.q_a_kv_a = weight("self_attn.kv_a_proj_with_mqa")
            self.q_proj = weight("self_attn.q_proj", 0, heads)
        else:
            self.q_a_norm = load("self_attn.q_a_layernorm.weight")
            self.q_a_kv_a = LinearWeight.of(torch.cat([load("self_attn.q_a_proj.weight"),
                                                       load("self_attn.kv_a_proj_with_mqa.weight")]), None, layout)
            self.q_proj = weight("self_attn.q_b_proj", 0, heads)
        self.q_a_size = c.q_lora_rank or 0
        self.kv_a_norm = load("self_attn.kv_a_layernorm.weight")
        kv_b = load("self_attn.kv_b_proj.weight", 0, shard.head_rows(self.nope + self.v_dim))
        kv_b = kv_b.view(self.num_heads, self.nope + self.v_dim, self.latent)
        self.w_uk = kv_b[:, :self.nope].contiguous()  # [heads, nope, L]: q_nope -> the latent's space
        self.w_uv = kv_b[:, self.nope:].transpose(1, 2).contiguous()  # [heads, L, v]: the latent -> values
        self.o_proj = weight("self_attn.o_proj", 1, shard.head_rows(self.v_dim))
        if layer == 0:
            log.info("multi-head latent attention: the cache keeps one latent row of %d a token and layer "
                     "(kv_lora_rank %d + rope %d), queries absorb W_UK", self.latent + self.rope, self.latent,
                     self.rope)
        self.moe = None
        if spec.moe is not None and spec.moe.sparse_layers[layer]:
            self.moe = DeepseekMoeBlock(spec, shard, layer, source, device, dtype, layout)
            return
        inter = shard.intermediate_rows()
        self.intermediate = shard.intermediate_size
        self.gate_up = LinearWeight.of(torch.cat([load("mlp.gate_proj.weight", 0, inter),
                                                  load("mlp.up_proj.weight", 0, inter)]), None, layout,
                                       gate_size=shard.intermediate_size)
        self.down = weight("mlp.down_proj", 1, inter)

    def _mlp(self, x: torch.Tensor, ew: Elementwise, lora: Optional[LoRABatch] = None,
             ops: Optional[ModuleType] = None) -> torch.Tensor:
        return super()._mlp(x, ew) if self.moe is None else self.moe.forward(x, ew)

    def _rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                ew: Elementwise) -> torch.Tensor:
        """q_pe [T, heads, R] and k_pe [T, R] rotated as transformers rotates them, as one [T, heads + 1, R]."""
        qk = torch.cat([q_pe, k_pe[:, None]], dim=1)
        if self.rope_form == ROPE_COMPLEX:  # DeepseekV2's apply_rotary_emb, op for op
            freqs = positions[:, None].float() * self.inv_freq
            freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * self.rotary.scaling
            pairs = torch.view_as_complex(qk.float().reshape(*qk.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * freqs_cis[:, None]).flatten(2).type_as(qk)
        if self.rope_form == ROPE_INTERLEAVED:  # even dims, then odd: the halves the shared rotary turns
            qk = torch.cat([qk[..., 0::2], qk[..., 1::2]], dim=-1)
        return ew.rotary(self.rotary, qk, positions)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ops: ModuleType,
                ew: Elementwise, output_rows: Optional[OutputRows] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward's contract; ``k_cache`` and ``v_cache`` are the one latent cache."""
        if residual is None:
            residual, x = hidden, ew.rms_norm(hidden, self.pre_attention_norm, self.eps)
        else:
            x, residual = self._join(hidden, residual, self.pre_attention_norm, ew)
        num_tokens, latent = x.shape[0], self.latent
        q_a_kv_a = linear(x, self.q_a_kv_a)
        kv_a = q_a_kv_a[:, self.q_a_size:]
        if self.q_a_norm is None:
            q = linear(x, self.q_proj)
        else:
            q_a = ew.rms_norm(q_a_kv_a[:, :self.q_a_size].contiguous(), self.q_a_norm, LATENT_NORM_EPS)
            q = linear(q_a, self.q_proj)
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)
        qk_pe = self._rotate(q[..., self.nope:], kv_a[:, latent:], batch.positions, ew)
        kv_nope = ew.rms_norm(kv_a[:, :latent].contiguous(), self.kv_a_norm, LATENT_NORM_EPS)
        cache_row = torch.cat([kv_nope, qk_pe[:, -1]], dim=-1).view(num_tokens, 1, latent + self.rope)
        ops.write_kv(cache_row, cache_row, k_cache, v_cache, batch.slot_mapping)
        tables, starts, seq_lens, plan = batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.attention_plan
        q_nope, q_pe = q[..., :self.nope], qk_pe[:, :-1]
        if output_rows is not None:
            rows = output_rows.rows
            num_tokens, residual = rows.shape[0], residual[rows]
            if num_tokens == 0:  # no request samples: the latent rows were all this step needed
                return residual, residual
            q_nope, q_pe, cache_row = q_nope[rows], q_pe[rows], cache_row[rows]
            tables, starts, seq_lens = output_rows.block_tables, output_rows.query_start_loc, output_rows.seq_lens
            plan = output_rows.attention_plan
        values = latent_attention(ops, q_nope, q_pe, cache_row, self.w_uk, self.w_uv, k_cache, tables, starts,
                                  seq_lens, self.scale, plan)
        out = linear(values.reshape(num_tokens, self.num_heads * self.v_dim), self.o_proj)
        out = self._finish(out, None, None, ew)
        x, residual = self._join(out, residual, self.pre_mlp_norm, ew)
        return self._finish(self._mlp(x, ew), None, None, ew), residual


# The checkpoint's attention names differ from LayerNames' (q_a/q_b/kv_a/kv_b): the layer reads them itself.
FAMILIES = {
    "DeepseekV2ForCausalLM": Family(LayerNames(), lambda config: _read_config(config, v3=False),
                                    layer=MlaDecoderLayer),
    "DeepseekV3ForCausalLM": Family(LayerNames(), lambda config: _read_config(config, v3=True),
                                    layer=MlaDecoderLayer),
}
