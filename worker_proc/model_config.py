"""What the worker needs to know about a model, read once from its HF ``config.json``.

transformers' own config classes parse the file (``AutoConfig``), so defaults and
legacy field names are resolved exactly as the oracle resolves them; this module only
picks out the shape of the network and refuses what the worker cannot run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pagedserve.protocol.model_identity import config_identity

# Architecture name in config.json -> model family flags. All four are the same
# pre-norm decoder (RMSNorm, rotary, GQA, SwiGLU); they differ only in these switches.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": dict(qk_norm=False),
    "MistralForCausalLM": dict(qk_norm=False),
    "Qwen2ForCausalLM": dict(qk_norm=False),
    "Qwen3ForCausalLM": dict(qk_norm=True),
}


class UnsupportedModelError(ValueError):
    """The model directory holds something this worker cannot run."""


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
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_sliding_windows: tuple[Optional[int], ...]  # per layer; None = full attention
    hf_config: Any  # the transformers config, for the rotary init functions

    @property
    def num_layer_params(self) -> int:
        """Weights in the decoder layers (not embeddings): about the FLOPs of one token / 2."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (q_and_o + k_and_v + mlp)

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5


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
    """Read ``model_dir/config.json``; raises UnsupportedModelError for other architectures."""
    from transformers import AutoConfig

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise UnsupportedModelError(f"{config_path} not found: is {model_dir!r} an HF model directory?")
    config_bytes = config_identity(config_path)  # not the bytes: transformers_version is not the model
    config = AutoConfig.from_pretrained(str(model_dir))
    architectures = getattr(config, "architectures", None) or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"model architecture {architectures or config.model_type!r} is not supported; "
            f"supported architectures: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    num_layers = config.num_hidden_layers
    return ModelSpec(
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
        qkv_bias=is_qwen2 or attention_bias,  # Qwen2 always has q/k/v bias, never o bias
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        layer_sliding_windows=_sliding_windows(config, num_layers),
        hf_config=config,
    )
