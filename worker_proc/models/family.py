"""What a model family declares: its checkpoint's names and a hook that reads its config.

The registry is ``protocol/model_architectures.py``'s ``ARCHITECTURES``: an HF architecture name ->
the module under ``worker_proc/models/`` that declares it (the launcher reads the names to refuse
a model before any process starts; the worker imports only the module it serves). That module
holds ``FAMILIES: dict[str, Family]``, one entry per architecture it declares.

Every family runs the one decoder (models/decoder_layer.py, models/causal_lm.py): paged attention,
the KV cache, tensor-parallel slices, CUDA graphs and the CPU kernels are shared. A family says
how it differs, as data:

- ``names``: the tensors of one layer in the checkpoint (``LayerNames``), under
  ``model.layers.{i}.``: q/k/v as three names or one fused ``qkv_proj``, gate/up as two or one,
  and which of the four norm places it fills (before and after attention, before and after the
  MLP: Llama fills the two before, Gemma all four, OLMo 2 the two after);
- ``read_config``: the hook that turns transformers' config object into the ``ModelSpec`` fields
  the family sets (model_config.py lists them: activation, attention scale, soft-capping, embedding
  and residual scales, q/k norm kind, per-layer rope, norm weight offset, biases), and raises
  ``UnsupportedModelError`` for a setting the decoder cannot compute exactly;
- ``tensor_parallel``: False where a layer cannot be cut by heads (OLMo 2's q/k norm spans the
  whole projection);
- ``layer``: the layer class, None for the shared ``DecoderLayer``. A family whose layers compute
  something the shared one does not (a mixture of experts, latent attention) gives its own class,
  with DecoderLayer's constructor and ``forward`` signature, in its file; CausalLM builds one per
  layer and calls them as it calls DecoderLayer (the paged cache, attention dispatch, tensor-parallel
  slices and kernels are still the shared ones it uses).

Adding a dense family: its file with ``FAMILIES``, one line in ``ARCHITECTURES``, a builder line in
tools/demo_model.py and a parity case in tests (docs/ARCHITECTURE.md, "How to add a model family").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedserve.protocol.model_architectures import ARCHITECTURES


@dataclass(frozen=True, slots=True)
class LayerNames:
    """A layer's tensors in the checkpoint, relative to ``model.layers.{i}.``, without ``.weight``."""
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # one name: fused rows
    o_proj: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")  # one name: fused [gate; up] rows
    down: str = "mlp.down_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    sinks: Optional[str] = None  # attention sinks, one logit per query head (gpt-oss: "self_attn.sinks")
    # The four places a norm may sit; None where the family has none.
    pre_attention_norm: Optional[str] = "input_layernorm"
    post_attention_norm: Optional[str] = None
    pre_mlp_norm: Optional[str] = "post_attention_layernorm"
    post_mlp_norm: Optional[str] = None


def _no_fields(config: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class Family:
    names: LayerNames = field(default_factory=LayerNames)
    read_config: Callable[[Any], dict[str, Any]] = _no_fields  # transformers config -> ModelSpec fields
    tensor_parallel: bool = True
    layer: Optional[Callable[..., Any]] = None  # None: models/decoder_layer.py's DecoderLayer


def family_of(architecture: str) -> Family:
    """The ``Family`` the registry names for ``architecture`` (its module imported now)."""
    module = importlib.import_module(f"pagedserve.worker_proc.models.{ARCHITECTURES[architecture]}")
    return module.FAMILIES[architecture]
