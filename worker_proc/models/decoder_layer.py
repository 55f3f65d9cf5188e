"""One decoder layer over the paged cache, for every dense family (models/family.py says how they differ).

Attention (grouped-query, optional q/k norm, rotary, soft-capping, sinks, a sliding window per layer) and a
gated MLP, each between the norms its family declares: before it (Llama), before and after (Gemma),
after only (OLMo 2). Weights are plain tensors, fused at load: q/k/v into one matmul and gate/up
into one, whether the checkpoint keeps them apart or fused (Phi-3); a quantized checkpoint's
projections are quantized layers (worker_proc/quantization.py). Norms, residual adds, rotary and
the SiLU gate go through an Elementwise (elementwise.py): transformers' op sequence, so float32
greedy tokens equal transformers', or fused kernels (on CPU in half precision, q/k rotary and the KV write
in one native call); where the matmuls are native (CPU), the SiLU
gate is part of gate_up's call (models/linear.py silu_gate). Each layer's residual add is deferred
to the next layer, where the fused path does it in the same op as that layer's first norm. With
``--enable-lora`` each projection's output takes its tokens' adapter deltas (models/lora_linear.py)
before anything reads it: q/k/v's before the norms and rotary, gate/up's before the gate, o's and
down's before the all-reduce.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.worker_proc.attention import attend
from pagedserve.worker_proc.elementwise import Elementwise
from pagedserve.worker_proc.input_batch import ForwardBatch, OutputRows
from pagedserve.worker_proc.model_config import ModelSpec, UnsupportedModelError
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout, linear, silu_gate
from pagedserve.worker_proc.models.lora_linear import LayerLoRA, LoRABatch, LoRAConfig, layer_lora
from pagedserve.worker_proc.quantization import load_projection
from pagedserve.worker_proc.rotary import RotaryEmbedding
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
from pagedserve.worker_proc.weights import WeightSource


def _rows(source: WeightSource, names: tuple[str, ...], suffix: str,
          parts: tuple[tuple[int, int], ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """This rank's rows of weights kept as len(parts) tensors, or fused in one (its parts one after
    another, each ``sizes[i]`` rows in the checkpoint)."""
    if len(names) == len(parts):
        return torch.cat([source.get(n + suffix, dim=0, part=p) for n, p in zip(names, parts, strict=True)])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([source.get(names[0] + suffix, dim=0, part=(o + a, o + b))
                      for o, (a, b) in zip(offsets, parts, strict=True)])


class DecoderLayer:
    def __init__(self, spec: ModelSpec, shard: TensorParallelShard, layer: int,
                 source: WeightSource, device: torch.device, dtype: torch.dtype,
                 layout: WeightLayout = WeightLayout(), rotary: Optional[RotaryEmbedding] = None,
                 dense_mlp: bool = True, lora: Optional[LoRAConfig] = None):
        """``layout``: whether to keep [in, out] copies of the projections too (models/linear.py).
        ``rotary``: this layer's table (models/causal_lm.py). ``dense_mlp``: False for a family's
        layer class that brings its own MLP (``_mlp``; models/moe.py): none is loaded here.
        ``lora``: allocate this layer's adapter slots (models/lora_linear.py)."""
        p = f"model.layers.{layer}."
        names = spec.family.names
        d = spec.head_dim
        self.eps = spec.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, d
        self.q_size, self.kv_size = shard.num_heads * d, shard.num_kv_heads * d
        self.scale, self.softcap = spec.attention_scale, spec.attn_logit_softcap
        self.residual_scale = spec.residual_scale
        self.sliding_window = spec.layer_sliding_windows[layer]
        self.shard, self.rotary = shard, rotary
        self.gelu = spec.hidden_act == "gelu_pytorch_tanh"
        self.intermediate = shard.intermediate_size

        def load(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        def norm(name: Optional[str]) -> Optional[torch.Tensor]:  # Gemma's (1 + weight), added once here
            return None if name is None else load(source.get(p + name + ".weight").float() + spec.norm_weight_offset)

        heads, kv_heads, inter = shard.head_rows(d), shard.kv_head_rows(d), shard.intermediate_rows()
        qkv_parts, qkv_sizes = (heads, kv_heads, kv_heads), (spec.num_heads * d, spec.num_kv_heads * d,
                                                             spec.num_kv_heads * d)
        self.pre_attention_norm, self.post_attention_norm = norm(names.pre_attention_norm), norm(names.post_attention_norm)
        self.pre_mlp_norm, self.post_mlp_norm = norm(names.pre_mlp_norm), norm(names.post_mlp_norm)
        quantized = getattr(source, "quantization", None) is not None

        def projection(checkpoint_names: tuple[str, ...], dim: int, parts: tuple, sizes: tuple,
                       bias: Optional[torch.Tensor], gate_size: int = 0) -> LinearWeight:
            """Float weights (fused here if the checkpoint keeps them apart), or a quantized
            checkpoint's layer (worker_proc/quantization.py), which reads them apart only."""
            full = tuple(p + n for n in checkpoint_names)
            if quantized:
                if len(full) != len(parts):
                    raise UnsupportedModelError(f"{full[0]}: a quantized checkpoint with fused projections "
                                                "is not supported")
                return load_projection(source, list(full), dim, list(parts), load, bias, layout, dtype, device,
                                       gate_size, shard)
            weight = (_rows(source, full, ".weight", parts, sizes) if dim == 0
                      else source.get(full[0] + ".weight", dim=1, part=parts[0]))
            return LinearWeight.of(load(weight), bias, layout, gate_size=gate_size)

        qkv_bias = (load(_rows(source, tuple(p + n for n in names.qkv), ".bias", qkv_parts, qkv_sizes))
                    if spec.qkv_bias else None)
        self.qkv = projection(names.qkv, 0, qkv_parts, qkv_sizes, qkv_bias)
        # o_proj's and down_proj's biases are added after the all-reduce (once, not per rank)
        self.o_proj = projection((names.o_proj,), 1, (heads,), (), None)
        self.o_bias = load(source.get(p + names.o_proj + ".bias")) if spec.o_bias else None
        # gpt-oss's attention sinks: this rank's heads' logits, float32 as the kernels read them
        self.sinks = None if names.sinks is None else source.get(p + names.sinks, dim=0, part=shard.head_rows(1))
        if self.sinks is not None:
            self.sinks = self.sinks.to(device, torch.float32).contiguous()
        self.qk_norm, self.q_norm_weight, self.k_norm_weight = spec.qk_norm, None, None
        if spec.qk_norm == "head":
            # One [q_heads + kv_heads, dim] weight lets a single norm call cover every head of q and k.
            self.qk_norm_weight = torch.cat([norm(names.q_norm).expand(shard.num_heads, d),
                                             norm(names.k_norm).expand(shard.num_kv_heads, d)])
        elif spec.qk_norm == "projection":  # over all of q and all of k (one rank holds every head)
            self.q_norm_weight, self.k_norm_weight = norm(names.q_norm), norm(names.k_norm)
        self.lora: Optional[LayerLoRA] = None if lora is None else layer_lora(
            names.qkv, names.gate_up if dense_mlp else None, names.o_proj, names.down if dense_mlp else None,
            spec.hidden_size, self.q_size, self.kv_size, shard.intermediate_size, lora, dtype, device)
        if not dense_mlp:
            self.down_bias = None
            return
        inter_parts, inter_sizes = (inter, inter), (spec.intermediate_size,) * 2
        gate_up_bias = (load(_rows(source, tuple(p + n for n in names.gate_up), ".bias", inter_parts, inter_sizes))
                        if spec.mlp_bias else None)
        # A GeLU gate multiplies through linear(): no panels interleaved for silu_gate. Nor with LoRA where the
        # native panels would interleave them: an adapter's delta joins gate and up before the gate.
        fused_gate = not self.gelu and not (lora is not None and layout.native)
        self.gate_up = projection(names.gate_up, 0, inter_parts, inter_sizes, gate_up_bias,
                                  gate_size=shard.intermediate_size if fused_gate else 0)
        self.down = projection((names.down,), 1, (inter,), (), None)
        self.down_bias = load(source.get(p + names.down + ".bias")) if spec.mlp_bias else None

    def _join(self, out: torch.Tensor, residual: torch.Tensor, norm: Optional[torch.Tensor],
              ew: Elementwise) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next block's input, the residual stream): ``out`` joins the residual, then the norm
        before the next block, where the family has one."""
        if norm is None:
            total = out.add_(residual)
            return total, total
        return ew.add_rms_norm(out, residual, norm, self.eps)

    def _finish(self, out: torch.Tensor, bias: Optional[torch.Tensor], norm: Optional[torch.Tensor],
                ew: Elementwise) -> torch.Tensor:
        """A block's output before it joins the residual: summed over ranks, its bias, the norm
        after it, the residual multiplier."""
        out = self.shard.all_reduce(out)
        if bias is not None:
            out = out + bias
        if norm is not None:
            out = ew.rms_norm(out, norm, self.eps)
        if self.residual_scale != 1.0:
            out = out * self.residual_scale
        return out

    def _qk(self, qkv: torch.Tensor, ew: Elementwise) -> torch.Tensor:
        """q and k, normed (not yet rotated) together as one [T, q_heads + kv_heads, dim] tensor."""
        num_tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
        if self.qk_norm == "projection":
            qk = torch.cat([ew.rms_norm(qkv[:, :self.q_size], self.q_norm_weight, self.eps),
                            ew.rms_norm(qkv[:, self.q_size:qk_size], self.k_norm_weight, self.eps)], dim=1)
            qk = qk.view(num_tokens, -1, self.head_dim)
        else:
            qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
            if self.qk_norm == "head":
                qk = ew.rms_norm(qk, self.qk_norm_weight, self.eps)
        return qk

    def _mlp(self, x: torch.Tensor, ew: Elementwise, lora: Optional[LoRABatch] = None,
             ops: Optional[ModuleType] = None) -> torch.Tensor:
        """This rank's part of the MLP's output (before the all-reduce): a family's layer class may
        compute another MLP here (models/moe.py). ``lora``: the step's adapter tokens, or None."""
        gated = self._gated(x, ew, lora, ops)
        out = linear(gated, self.down)
        return out if lora is None else self.lora.down.add_delta(gated, out, lora, ops)

    def _gated(self, x: torch.Tensor, ew: Elementwise, lora: Optional[LoRABatch],
               ops: Optional[ModuleType]) -> torch.Tensor:
        """The MLP's input to down_proj: act(gate) * up."""
        if lora is None and self.gate_up.gate_size:
            return silu_gate(x, self.gate_up, ew)
        gate_up = linear(x, self.gate_up)
        if lora is not None:
            self.lora.gate_up.add_delta(x, gate_up, lora, ops)
        if not self.gelu:
            return ew.silu_mul(gate_up, self.intermediate)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ops: ModuleType,
                ew: Elementwise, output_rows: Optional[OutputRows] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it). The previous layer's output
        joins the residual here, in the same op as this layer's first norm; ``residual`` is
        None for the first layer, whose input is the embeddings. ``output_rows``: every token's
        keys and values are written, but only those rows come out (the last layer)."""
        num_tokens = hidden.shape[0]
        if residual is None:
            residual = hidden
            x = hidden if self.pre_attention_norm is None else ew.rms_norm(hidden, self.pre_attention_norm, self.eps)
        else:
            x, residual = self._join(hidden, residual, self.pre_attention_norm, ew)
        lora = batch.lora if self.lora is not None else None
        qkv = linear(x, self.qkv)
        if lora is not None:
            self.lora.qkv.add_delta(x, qkv, lora, ops)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        qk = ew.rotary_write_kv(self.rotary, self._qk(qkv, ew), batch.positions, v, k_cache, v_cache,
                                batch.slot_mapping, ops)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if output_rows is None:
            attn = attend(ops, q, k, v, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                          self.scale, self.sliding_window, batch.attention_plan, self.softcap, self.sinks)
        else:
            rows = output_rows.rows
            num_tokens, residual = rows.shape[0], residual[rows]
            if num_tokens == 0:  # no request samples: the keys and values were all this step needed
                return residual, residual
            attn = attend(ops, q[rows], k[rows], v[rows], k_cache, v_cache, output_rows.block_tables,
                          output_rows.query_start_loc, output_rows.seq_lens, self.scale, self.sliding_window,
                          output_rows.attention_plan, self.softcap, self.sinks)
            lora = lora.rows(rows) if lora is not None else None
        attn = attn.reshape(num_tokens, self.q_size)
        out = linear(attn, self.o_proj)
        if lora is not None:
            self.lora.o.add_delta(attn, out, lora, ops)
        out = self._finish(out, self.o_bias, self.post_attention_norm, ew)
        x, residual = self._join(out, residual, self.pre_mlp_norm, ew)
        mlp = self._mlp(x, ew) if lora is None else self._mlp(x, ew, lora, ops)
        return self._finish(mlp, self.down_bias, self.post_mlp_norm, ew), residual
