"""The model architectures the workers run, and the checks of a model's config.json that need
no worker: the one registry of families, read by the launcher before any process starts and by
the worker when it loads a model.

It lives in protocol/ because it is an agreement between processes: ``pagedserve serve`` (deploy/,
which must not import worker_proc) refuses a model the workers would refuse, in one line, before
it starts them, and the worker resolves each name to its family's file from the same table, so
the two can never disagree. Only names and plain JSON are read here (no torch, no transformers):
the check costs a file read.

A family's file is ``worker_proc/models/<module>.py``; it declares a ``FAMILIES`` dict from these
architecture names to its ``Family`` (worker_proc/models/family.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# config.json's "architectures" name -> the module under worker_proc/models/ that declares it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen",
    "Qwen3ForCausalLM": "qwen",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen_moe",
    "Qwen3MoeForCausalLM": "qwen_moe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
}
# A mixture of experts' expert count, by the name its family's config.json gives it.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


LONGROPE_LIMIT = ("longrope rotary scaling: sequences up to original_max_position_embeddings ({limit}) are computed "
                  "exactly; past it transformers recomputes the whole sequence with the long factors, which the paged "
                  "cache cannot, so a served length of {asked} is refused: set --max-model-len {limit} or less")


class ModelConfigError(ValueError):
    """A model directory whose config.json names no supported architecture, or contradicts itself."""


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found: is {str(model_dir)!r} an HF model directory?")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return config


def supported_architecture(config: dict[str, Any], model_impl: str = "native") -> str:
    """The first of config.json's architectures the workers run (``--model-impl``: a native family,
    or, unless ``native``, any causal LM transformers defines, for the backend to probe at start);
    ModelConfigError naming the native ones otherwise."""
    named = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    shown = named or config.get("model_type") or "none"
    native = ", ".join(sorted(ARCHITECTURES))
    if model_impl != "transformers":
        arch = next((a for a in named if a in ARCHITECTURES), None)
        if arch is not None:
            return arch
        if model_impl == "native":
            raise ModelConfigError(f"model architecture {shown!r} is not supported; supported architectures: {native}")
    arch = next((a for a in named if a in _transformers_causal_lms()), None)
    if arch is None:
        raise ModelConfigError(f"model architecture {shown!r} is not supported: no native family (those are "
                               f"{native}) and no causal LM of transformers for the transformers backend")
    return arch


def _transformers_causal_lms() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _positive_int(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def check_model_config(model_dir: str | Path, model_impl: str = "native") -> str:
    """The architecture to run; ModelConfigError (one line) for an unsupported one or a config that
    breaks its own rules: query heads that do not group over the key/value heads, layer types that do
    not cover the layers, a window that is not a positive length or is missing for its sliding layers,
    a mixture of experts routing each token to more experts than it has (or to none).

    A window longer than ``max_position_embeddings`` is not refused: it never binds (every position
    sees all before it, in transformers as here), and real checkpoints ship one (Phi-3.5-mini and
    Phi-3-mini-128k: a window of 262144 over 131072 positions)."""
    config = read_model_config(model_dir)
    arch = supported_architecture(config, model_impl)
    _positive_int(config, "max_position_embeddings")
    layers = _positive_int(config, "num_hidden_layers")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelConfigError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                               f"num_key_value_heads ({kv_heads})")
    layer_types = config.get("layer_types")
    if layer_types is not None and layers is not None and len(layer_types) != layers:
        raise ModelConfigError(f"config.json: layer_types names {len(layer_types)} layers but num_hidden_layers "
                               f"is {layers}")
    # A window its config turns off is never read: transformers' Qwen2-MoE config writes 0 there then.
    window = None if config.get("use_sliding_window") is False else _positive_int(config, "sliding_window")
    if window is None and layer_types is not None and "sliding_attention" in layer_types:
        raise ModelConfigError("config.json: layer_types has sliding_attention layers but no sliding_window")
    _check_experts(config)
    _check_expert_groups(config)
    return arch


def longrope_limit(config: dict[str, Any]) -> int | None:
    """The longest sequence a longrope model (Phi-3) is computed exactly in a paged cache: its short
    factors' length (worker_proc/rotary.py says why); None for every other rope."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return None
    limit = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    return int(limit) if limit else None


def _check_experts(config: dict[str, Any]) -> None:
    """A mixture of experts routes each token to num_experts_per_tok of its experts: at least one,
    and no more than it has."""
    top_k = config.get("num_experts_per_tok")
    key = next((k for k in EXPERT_COUNT_KEYS if config.get(k) is not None), None)
    if top_k is None or key is None or config[key] == 0:  # no experts: every layer's MLP is dense (Qwen2-MoE)
        return
    experts = _positive_int(config, key)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ModelConfigError(f"config.json: num_experts_per_tok={top_k!r} needs between 1 and "
                               f"{key}={experts} experts to pick from")


def _check_expert_groups(config: dict[str, Any]) -> None:
    """DeepSeek's grouped top-k (V3 always; V2 with topk_method group_limited_greedy): ``n_group``
    groups split the experts evenly, the ``topk_group`` best of them hold at least the top k, and V3,
    which scores a group by its two best experts, has two in each."""
    model_type, method = config.get("model_type"), config.get("topk_method", "greedy")
    if model_type not in ("deepseek_v2", "deepseek_v3") or not config.get("n_routed_experts"):
        return
    if model_type == "deepseek_v2":
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelConfigError(f"config.json: topk_method {method!r} is not supported (greedy, "
                                   "group_limited_greedy)")
        if method == "greedy":
            return
    experts, top_k = config["n_routed_experts"], config.get("num_experts_per_tok") or 0
    groups = _positive_int(config, "n_group") or 1
    chosen = _positive_int(config, "topk_group") or 1
    if experts % groups or chosen > groups:
        raise ModelConfigError(f"config.json: n_routed_experts={experts} in n_group={groups} groups with "
                               f"topk_group={chosen}: the groups must split the experts evenly and topk_group be "
                               "at most n_group")
    if top_k > chosen * (experts // groups):
        raise ModelConfigError(f"config.json: num_experts_per_tok={top_k} is more than the topk_group={chosen} "
                               f"groups of {experts // groups} experts hold")
    if model_type == "deepseek_v3" and experts // groups < 2:
        raise ModelConfigError(f"config.json: DeepSeek-V3 scores a group by its two best experts; n_group={groups} "
                               f"leaves {experts // groups} in each")
