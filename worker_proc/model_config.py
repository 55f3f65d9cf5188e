"""What the worker needs to know about a model, read once from its HF ``config.json``.

transformers' own config classes parse the file (``AutoConfig``), so defaults and
legacy field names are resolved exactly as the oracle resolves them; this module only
picks out the shape of the network and refuses what the worker cannot run. The architecture
names come from protocol/model_architectures.py (the check ``pagedserve serve`` runs before
any process starts), and each family's hook (models/family.py) sets the fields below that
differ from the Llama defaults.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pagedserve.protocol.model_architectures import ModelConfigError, check_model_config
from pagedserve.protocol.model_identity import config_identity
from pagedserve.worker_proc.kv_cache import KVCacheSpec


class UnsupportedModelError(ModelConfigError):
    """The model directory holds something this worker cannot run."""


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# RMSNorm of q and k: none, of each head (Qwen3, Gemma 3), or of all of q and all of k (OLMo 2)
QK_NORMS = (None, "head", "projection")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    model_id: str  # architecture + short hash of config.json: workers of one replica must agree
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_sliding_windows: tuple[Optional[int], ...]  # per layer; None = full attention
    hf_config: Any  # the transformers config, for the rotary init functions
    family: Any  # models/family.py's Family: the checkpoint's names
    # What a family's read_config may set (the defaults are Llama's):
    qk_norm: Optional[str] = None  # one of QK_NORMS
    hidden_act: str = "silu"  # the gated MLP's activation, one of GATED_ACTIVATIONS
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_logit_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcap: Optional[float] = None  # the same on the logits
    embedding_scale: float = 1.0  # the embeddings times this (Gemma: sqrt(hidden), Granite: its multiplier)
    residual_scale: float = 1.0  # each attention and MLP output times this before it joins the residual
    logits_divisor: float = 1.0  # the logits over this (Granite's logits_scaling)
    norm_weight_offset: float = 0.0  # Gemma's norms scale by (1 + weight): 1.0, added at load
    layer_rope_types: Optional[tuple[str, ...]] = None  # per layer, the key of its rope parameters (Gemma 3)
    moe: Any = None  # a mixture of experts' models/moe.py MoeSpec; None: every layer's MLP is dense
    # Multi-head latent attention (DeepSeek): the cache keeps one latent row of this width per token and
    # layer, replicated on every rank (kv_cache.py KVCacheSpec.latent); 0: per-head K and V
    latent_cache_dim: int = 0
    attention_params: int = 0  # one layer's attention weights where they are not q/k/v/o of heads (MLA); 0: those

    def __post_init__(self) -> None:
        if self.attention_scale == 0.0:
            object.__setattr__(self, "attention_scale", self.head_dim**-0.5)
        if self.hidden_act not in GATED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported (only "
                                        f"{', '.join(GATED_ACTIVATIONS)})")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r}: one of {QK_NORMS}")

    def cache_spec(self, kv_heads_on_rank: int) -> KVCacheSpec:
        """What the paged cache keeps per token and layer on a rank holding ``kv_heads_on_rank`` KV heads."""
        if self.latent_cache_dim:
            return KVCacheSpec.latent(self.latent_cache_dim)
        return KVCacheSpec.per_head(kv_heads_on_rank, self.head_dim)

    @property
    def num_layer_params(self) -> int:
        """Weights in the decoder layers (not embeddings): about the FLOPs of one token / 2
        (of a mixture of experts, every expert's weights: what memory holds)."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        if self.attention_params:
            q_and_o, k_and_v = self.attention_params, 0
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        sparse = sum(self.moe.sparse_layers) if self.moe else 0
        sparse_mlp = self.moe.layer_params(self.hidden_size) if self.moe else 0
        return self.num_layers * (q_and_o + k_and_v) + (self.num_layers - sparse) * dense_mlp + sparse * sparse_mlp


def _sliding_windows(config: Any, num_layers: int) -> tuple[Optional[int], ...]:
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # Qwen2/Qwen3: only layers marked "sliding_attention" use the window
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    return (window,) * num_layers  # Mistral: every layer


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read ``model_dir/config.json``; raises UnsupportedModelError (a ModelConfigError) for
    architectures or settings the worker cannot run, in one line."""
    from transformers import AutoConfig

    from pagedserve.worker_proc.models.family import family_of

    try:
        arch = check_model_config(model_dir)
    except UnsupportedModelError:
        raise
    except ModelConfigError as exc:  # the worker's callers catch one type, whoever found the fault
        raise UnsupportedModelError(str(exc)) from None
    config_bytes = config_identity(Path(model_dir) / "config.json")  # transformers_version is not the model
    config = AutoConfig.from_pretrained(str(model_dir))
    family = family_of(arch)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    num_layers = config.num_hidden_layers
    fields: dict[str, Any] = dict(
        architecture=arch,
        model_id=f"{arch}:{hashlib.sha256(config_bytes).hexdigest()[:16]}",
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        layer_sliding_windows=_sliding_windows(config, num_layers),
        hf_config=config,
        family=family,
        hidden_act=getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu",
    )
    fields.update(family.read_config(config))
    return ModelSpec(**fields)
