"""The causal LM of every dense family: embeddings, decoder layers over the paged cache, final norm, lm_head.

A family's scales sit here: the embeddings' (Gemma, Granite), the logits' divisor (Granite) and their
soft cap (Gemma 2), applied to the float32 logits (transformers applies them to lm_head's output in the
model's dtype: the same ops in float32, one rounding fewer in half precision).

Embeddings and lm_head are replicated on every tensor-parallel rank (only rank 0
samples); lm_head is the embedding matrix when the config ties them. On CPU the matrices are
kept in the layouts that run fastest for the model's size (models/linear.py): oneDNN's packed
copy (lm_head's a copy beside the embeddings), an [in, out] copy, or both.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.worker_proc.input_batch import ForwardBatch
from pagedserve.worker_proc.model_config import ModelSpec
from pagedserve.worker_proc.elementwise import Elementwise, TorchElementwise
from pagedserve.worker_proc.models.decoder_layer import DecoderLayer
from pagedserve.worker_proc.models.linear import LinearWeight, linear, weight_layout
from pagedserve.worker_proc.models.quantized_linear import dequantize_min_rows
from pagedserve.worker_proc.quantization import load_projection, stored_quantized
from pagedserve.worker_proc.models.lora_linear import LoRAConfig
from pagedserve.worker_proc.rotary import RotaryTables
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard
from pagedserve.worker_proc.weights import open_weights


def _is_gguf(source) -> bool:
    return getattr(source, "quantized_reader", None) is not None


def _stores_own_quantized_lm_head(source) -> bool:
    """A compressed-tensors or GPTQ checkpoint whose lm_head has quantized tensors: that is its lm_head, even
    under ``tie_word_embeddings`` (llm-compressor unties the pair to quantize lm_head; the embeddings, which
    stay float, are still what the lookup reads). A GGUF's ``output`` is read by the config's tie as before."""
    return not _is_gguf(source) and stored_quantized(source, "lm_head") is not None


class CausalLM:
    def __init__(self, model_dir: str, spec: ModelSpec, shard: TensorParallelShard,
                 device: torch.device, dtype: torch.dtype, elementwise: Elementwise = TorchElementwise(),
                 lora: Optional[LoRAConfig] = None):
        """``lora``: every layer allocates its adapter slots (models/lora_linear.py)."""
        self.spec, self.shard, self.device, self.dtype = spec, shard, device, dtype
        self.elementwise = elementwise
        source = open_weights(model_dir)
        try:
            self.embed_tokens = source.get("model.embed_tokens.weight").to(device, dtype)
            tied = not _stores_own_quantized_lm_head(source) and (spec.tie_word_embeddings
                                                                  or "lm_head.weight" not in source)
            num_params = spec.num_layer_params + self.embed_tokens.numel() * (1 if tied else 2)
            layout = weight_layout(device, num_params * self.embed_tokens.element_size(), dtype)
            self.lm_head = self._lm_head(source, tied, layout)
            self.norm = (source.get("model.norm.weight").float() + spec.norm_weight_offset).to(device, dtype)
            rope_types = spec.layer_rope_types or (None,) * spec.num_layers
            self.rotary = RotaryTables(spec.hf_config, spec.head_dim, spec.max_position_embeddings, device, dtype,
                                       rope_types)
            layer = spec.family.layer or DecoderLayer
            with_lora = {} if lora is None else {"lora": lora}
            self.layers = [layer(spec, shard, i, source, device, dtype, layout, self.rotary[rope_types[i]], **with_lora)
                           for i in range(spec.num_layers)]
        finally:
            source.close()
        # transformers rounds Gemma's sqrt(hidden) to the weights' dtype before multiplying
        self.embedding_scale = (None if spec.embedding_scale == 1.0
                                else torch.tensor(spec.embedding_scale, dtype=dtype, device=device))
        # each layer's (KV group, cache slot) where the cache is laid out in groups (protocol/kv_groups.py)
        self.kv_layer_slots: Optional[tuple[tuple[int, int], ...]] = None

    def _lm_head(self, source, tied: bool, layout) -> LinearWeight:
        """The embeddings (tied) or lm_head, as the checkpoint stores it: a quantized one as its integer layer
        (models/quantized_linear.py; the decode step's largest read), so the logits of the sampled rows run on
        the int4 / int8 GEMV. Only a GGUF's Q8_0 / Q4_0 matrix may be read in float instead, q * scale exactly:
        on a GPU, and where its layer would dequantize it at every call (float32, but for the int4 GEMV)."""
        name = "model.embed_tokens" if tied else "lm_head"
        gguf = _is_gguf(source)
        if stored_quantized(source, name) is not None and (self.device.type == "cpu" or not gguf):
            head = load_projection(source, [name], 0, [None], lambda t: t, None, layout, self.dtype, self.device)
            if not (gguf and dequantize_min_rows(head.quantized.kind, self.dtype) == 1):
                return head
        head = self.embed_tokens if tied else source.get("lm_head.weight").to(self.device, self.dtype)
        return LinearWeight.of(head, None, layout)

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """Hidden states [T, hidden] of every token in the batch (before the final norm); only
        the rows ``batch.output_rows`` names, in order, where it names them."""
        hidden, residual = F.embedding(batch.input_ids, self.embed_tokens), None
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        last = len(self.layers) - 1
        if batch.window_views is not None:
            return self._forward_grouped(hidden, batch, kv_cache, ops)
        for i, layer in enumerate(self.layers):
            # V is the last kind: with one (a latent cache, kv_cache.py) keys and values read the same rows
            hidden, residual = layer.forward(hidden, residual, batch, kv_cache[i, 0], kv_cache[i, -1],
                                             ops, self.elementwise, batch.output_rows if i == last else None)
        return hidden.add_(residual)

    def _forward_grouped(self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                         ops: ModuleType) -> torch.Tensor:
        """forward() over a cache in KV groups (protocol/kv_groups.py): each layer reads and writes its
        layer slot of the cache through its group's tables (``batch`` for the global group, else
        ``batch.window_views``)."""
        if self.kv_layer_slots is None:
            raise RuntimeError("a batch with local KV groups for a model whose cache is not grouped")
        views, last, residual = [batch, *batch.window_views], len(self.layers) - 1, None
        for i, (layer, (group, slot)) in enumerate(zip(self.layers, self.kv_layer_slots)):
            view = views[group]
            hidden, residual = layer.forward(hidden, residual, view, kv_cache[slot, 0], kv_cache[slot, -1],
                                             ops, self.elementwise, view.output_rows if i == last else None)
        return hidden.add_(residual)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The given rows of forward()'s output after the final norm (transformers' last_hidden_state)."""
        return self.elementwise.rms_norm(hidden, self.norm, self.spec.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the given rows of forward()'s output."""
        logits = linear(self.final_norm(hidden), self.lm_head).float()
        spec = self.spec
        if spec.logits_divisor != 1.0:
            logits = logits / spec.logits_divisor
        if spec.final_logit_softcap is not None:
            logits = torch.tanh(logits / spec.final_logit_softcap) * spec.final_logit_softcap
        return logits
