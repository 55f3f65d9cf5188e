"""One pre-norm decoder layer of the Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged cache.

Weights are plain tensors, fused at load: q/k/v into one matmul and gate/up into one (a quantized
checkpoint's projections are quantized layers, worker_proc/quantization.py).
Norms, residual adds, rotary and the SiLU gate go through an Elementwise (elementwise.py):
transformers' op sequence, so float32 greedy tokens equal transformers', or fused kernels; where
the matmuls are native (CPU), the SiLU gate is part of gate_up's call (models/linear.py silu_gate).
Each layer's residual add is deferred to the next norm, so the fused path does both in one.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pagedserve.worker_proc.attention import attend
from pagedserve.worker_proc.elementwise import Elementwise
from pagedserve.worker_proc.input_batch import ForwardBatch, OutputRows
from pagedserve.worker_proc.model_config import ModelSpec
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout, linear, silu_gate
from pagedserve.worker_proc.quantization import load_projection
from pagedserve.worker_proc.rotary import RotaryEmbedding
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
from pagedserve.worker_proc.weights import WeightSource


def _maybe(source: WeightSource, name: str, present: bool, **part) -> Optional[torch.Tensor]:
    return source.get(name, **part) if present else None


class DecoderLayer:
    def __init__(self, spec: ModelSpec, shard: TensorParallelShard, layer: int,
                 source: WeightSource, device: torch.device, dtype: torch.dtype,
                 layout: WeightLayout = WeightLayout()):
        """``layout``: whether to keep [in, out] copies of the projections too (models/linear.py)."""
        p = f"model.layers.{layer}."
        d = spec.head_dim
        self.eps = spec.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, d
        self.q_size, self.kv_size = shard.num_heads * d, shard.num_kv_heads * d
        self.scale = spec.attention_scale
        self.sliding_window = spec.layer_sliding_windows[layer]
        self.shard = shard

        def load(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        heads, kv_heads, inter = shard.head_rows(d), shard.kv_head_rows(d), shard.intermediate_rows()
        attn, mlp = p + "self_attn.", p + "mlp."
        self.input_norm = load(source.get(p + "input_layernorm.weight"))
        self.post_norm = load(source.get(p + "post_attention_layernorm.weight"))
        qkv_bias = load(torch.cat([
            source.get(attn + "q_proj.bias", dim=0, part=heads),
            source.get(attn + "k_proj.bias", dim=0, part=kv_heads),
            source.get(attn + "v_proj.bias", dim=0, part=kv_heads),
        ])) if spec.qkv_bias else None
        def projection(names: list[str], dim: int, parts: list, bias: Optional[torch.Tensor] = None,
                       gate_size: int = 0) -> LinearWeight:  # float, or quantized (worker_proc/quantization.py)
            return load_projection(source, names, dim, parts, load, bias, layout, dtype, device, gate_size)

        self.qkv = projection([attn + "q_proj", attn + "k_proj", attn + "v_proj"], 0, [heads, kv_heads, kv_heads],
                              qkv_bias)
        # o_proj's and down_proj's biases are added after the all-reduce (once, not per rank)
        self.o_proj = projection([attn + "o_proj"], 1, [heads])
        self.o_bias = load(_maybe(source, attn + "o_proj.bias", spec.o_bias))
        # Qwen3 normalises each head of q and k; one [q_heads + kv_heads, dim] weight
        # lets a single norm call cover both.
        self.qk_norm_weight = load(torch.cat([
            source.get(attn + "q_norm.weight").expand(shard.num_heads, d),
            source.get(attn + "k_norm.weight").expand(shard.num_kv_heads, d),
        ])) if spec.qk_norm else None
        gate_up_bias = load(torch.cat([
            source.get(mlp + "gate_proj.bias", dim=0, part=inter),
            source.get(mlp + "up_proj.bias", dim=0, part=inter),
        ])) if spec.mlp_bias else None
        self.gate_up = projection([mlp + "gate_proj", mlp + "up_proj"], 0, [inter, inter], gate_up_bias,
                                  gate_size=shard.intermediate_size)
        self.down = projection([mlp + "down_proj"], 1, [inter])
        self.down_bias = load(_maybe(source, mlp + "down_proj.bias", spec.mlp_bias))

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, rotary: RotaryEmbedding, ops: ModuleType,
                ew: Elementwise, output_rows: Optional[OutputRows] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it). The previous layer's output
        joins the residual here, in the same op as this layer's first norm; ``residual`` is
        None for the first layer, whose input is the embeddings. ``output_rows``: every token's
        keys and values are written, but only those rows come out (the last layer)."""
        num_tokens = hidden.shape[0]
        if residual is None:
            residual, normed = hidden, ew.rms_norm(hidden, self.input_norm, self.eps)
        else:
            normed, residual = ew.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        qkv = linear(normed, self.qkv)
        # q and k rotate together as one [T, q_heads + kv_heads, dim] tensor.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm_weight is not None:
            qk = ew.rms_norm(qk, self.qk_norm_weight, self.eps)
        qk = ew.rotary(rotary, qk, batch.positions)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if output_rows is None:
            attn = attend(ops, q, k, v, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                          self.scale, self.sliding_window, batch.attention_plan)
        else:
            rows = output_rows.rows
            num_tokens, residual = rows.shape[0], residual[rows]
            if num_tokens == 0:  # no request samples: the keys and values were all this step needed
                return residual, residual
            attn = attend(ops, q[rows], k[rows], v[rows], k_cache, v_cache, output_rows.block_tables,
                          output_rows.query_start_loc, output_rows.seq_lens, self.scale, self.sliding_window,
                          output_rows.attention_plan)
        out = self.shard.all_reduce(linear(attn.reshape(num_tokens, self.q_size), self.o_proj))
        if self.o_bias is not None:
            out = out + self.o_bias
        normed, residual = ew.add_rms_norm(out, residual, self.post_norm, self.eps)
        out = self.shard.all_reduce(linear(silu_gate(normed, self.gate_up, ew), self.down))
        if self.down_bias is not None:
            out = out + self.down_bias
        return out, residual
