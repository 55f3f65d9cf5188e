"""A LoRA adapter directory in PEFT's format, read and judged the same way in every process.

The frontend reads an adapter before it accepts it (a bad one is a 4xx naming the reason),
the offline ``LLM`` does the same, and each worker reads it again when it loads the tensors:
one reader, so the three can never disagree about what an adapter holds. Reading checks
only ``adapter_config.json`` and the safetensors header (no tensor is read), so it is cheap
enough for a request path.

What is served: ``peft_type`` LORA on the attention and MLP projections of the decoder
layers, a mixture of experts' shared expert (``mlp.shared_expert.*``) and its routed experts,
rank at most ``--max-lora-rank``, ``lora_alpha`` with or without rsLoRA. What is refused, by
name: DoRA, ``modules_to_save``, embedding or lm_head adapters, ``rank_pattern`` / ``alpha_pattern``
on anything but the routed experts, LoRA biases, ``layers_to_transform``, per-expert modules
(transformers 4's ``experts.N.*`` layout) and ``target_parameters`` other than the experts' two.

The routed experts are transformers 5's fused 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]; gpt-oss keeps them [E, in, out]), which PEFT reaches with
``LoraConfig(target_parameters=[...])`` (its ``ParamWrapper``): one A of ``[r * E, in]`` (expert e's
rows ``e * r : (e + 1) * r``) and one B of ``[out, r * E]`` (expert e's columns ``e::E``), rank r and
the scaling per expert as for a linear. Two targeted parameters of one module nest two wrappers,
saved as ``mlp.experts.base_layer.lora_A`` (the one wrapped first) and ``mlp.experts.lora_A``;
PEFT wraps a module's parameters in the order the module registers them, gate_up_proj before
down_proj in every transformers 5 experts class (``EXPERT_PARAMETERS``). An adapter made with
``target_modules`` naming Mixtral's or Qwen3-MoE's expert projections (``w1``/``w3``/``w2``,
``gate_proj``/``up_proj``/``down_proj``, or ``all-linear``) is converted by PEFT to these parameters,
gate and up fused at twice the rank and alpha: it saves ``rank_pattern`` / ``alpha_pattern`` entries
(``.*\\.gate_up_proj``), read here as PEFT reads them (``_pattern``) and served on the experts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, by the names PEFT gives the base model's modules.
# qkv_proj / gate_up_proj are the fused projections of checkpoints that store them fused (Phi-3).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
# A mixture of experts' shared expert: plain linears under mlp.shared_expert. (Qwen2-MoE)
SHARED_EXPERT_MODULES = tuple(f"shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj"))
# The routed experts' fused parameters, in the order their modules register them (PEFT's nesting order)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
EXPERT_MODULES = tuple(f"experts.{p}" for p in EXPERT_PARAMETERS)

_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.([\w.]+?)\.lora_([AB])\.weight$")
_EXPERTS = re.compile(r"experts((?:\.base_layer)*)$")
_SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_MAX_HEADER_BYTES = 100 * 2**20


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message says which file and why, for a 4xx."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What one adapter directory holds, as read from its config and its tensors' header."""

    path: str  # the resolved directory
    rank: int  # the largest of its modules' (the config's r, or a rank_pattern's on the experts)
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA: folded into B at load
    # sorted short names that have tensors, e.g. ("k_proj", "q_proj"); a mixture of experts' as
    # "shared_expert.gate_proj" and "experts.gate_up_proj" / "experts.down_proj"
    target_modules: tuple[str, ...]
    num_layers: int  # 1 + the highest layer index with a tensor
    # (layer, module, "A" | "B") -> (safetensors dtype, shape): A is [r, in], B is [out, r]; the routed
    # experts' A is [r * E, in] and B [out, r * E] (PEFT's layout: module docstring)
    tensors: dict[tuple[int, str, str], tuple[str, tuple[int, ...]]]
    tensor_names: dict[tuple[int, str, str], str]  # the same keys -> the name in the file
    digest: str  # sha256 over the config's and the weights' bytes: a replay loads the same adapter
    # (layer, module) -> (rank, scaling): the config's, or its rank / alpha pattern's for that module
    modules: dict[tuple[int, str], tuple[int, float]]


def _refuse(path: Path, why: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path}: {why}")


def _config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise _refuse(path, f"no {CONFIG_FILE} (not a PEFT adapter directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    return cfg


def _check_config(path: Path, cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config whose every setting is one this engine serves."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {cfg.get('peft_type')!r} is not served (only LORA)")
    if cfg.get("use_dora"):
        raise _refuse(path, "DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {cfg['modules_to_save']} is not supported")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(name) or {}, dict):
            raise _refuse(path, f"{name}={cfg[name]!r} is not a mapping of module patterns")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise _refuse(path, "LoRA biases (bias / lora_bias) are not supported")
    if cfg.get("layers_to_transform") is not None:
        raise _refuse(path, "layers_to_transform is not supported")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(path, "fan_in_fan_out (Conv1D-style weights) is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(path, f"r={rank!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _refuse(path, f"lora_alpha={alpha!r} is not a finite number")
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def expert_parameters(path: Path, cfg: dict) -> tuple[str, ...]:
    """The experts' parameters the config's ``target_parameters`` names (EXPERT_PARAMETERS' order);
    refuses any other parameter it names."""
    named = cfg.get("target_parameters") or ()
    if isinstance(named, str) or not isinstance(named, (list, tuple)):
        raise _refuse(path, f"target_parameters={named!r} is not a list of parameter names")
    found = set()
    for entry in named:  # "mlp.experts.down_proj", or PEFT's conversion's bare "down_proj"
        short = entry.rsplit(".", 2)[-2:] if isinstance(entry, str) else ()
        if not short or short[-1] not in EXPERT_PARAMETERS or (len(short) == 2 and short[0] != "experts"):
            raise _refuse(path, f"target_parameters entry {entry!r} is not served (only the mixture-of-experts "
                                f"parameters experts.{' and experts.'.join(EXPERT_PARAMETERS)})")
        found.add(short[-1])
    return tuple(p for p in EXPERT_PARAMETERS if p in found)


def _module(path: Path, name: str, where: str, targeted: tuple[str, ...]) -> str:
    """The served module a tensor's module path names (``q_proj``, ``shared_expert.up_proj``,
    ``experts.down_proj``): the experts' by the depth of PEFT's nested wrappers."""
    experts = _EXPERTS.fullmatch(where)
    if experts is not None:
        depth = experts.group(1).count(".base_layer")
        if depth >= len(targeted):
            raise _refuse(path, f"tensor {name} adapts the experts, but target_parameters names "
                                f"{len(targeted) or 'none'} of their parameters")
        return f"experts.{targeted[len(targeted) - 1 - depth]}"  # the outermost wrapper: the last wrapped
    if where.startswith("experts."):
        raise _refuse(path, f"tensor {name}: adapters on single experts' modules (transformers 4's experts.N.*) "
                            "are not supported; target the fused experts with target_parameters")
    if where not in SUPPORTED_MODULES + SHARED_EXPERT_MODULES:
        raise _refuse(path, f"module {where!r} is not supported (supported: {', '.join(SUPPORTED_MODULES)}, "
                            f"{', '.join(SHARED_EXPERT_MODULES)}, {', '.join(EXPERT_MODULES)})")
    return where


def _pattern(path: Path, cfg: dict, name: str, key: str) -> Optional[tuple[str, object]]:
    """(pattern, value) of the first ``cfg[name]`` entry that names ``key`` as PEFT matches them
    (``peft.utils.other.get_pattern_key``: the pattern is the key's end, after a dot), or None."""
    for pattern, value in (cfg.get(name) or {}).items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return pattern, value
        except re.error:
            raise _refuse(path, f"{name} key {pattern!r} is not a regular expression") from None
    return None


def _module_settings(path: Path, cfg: dict, key: str, module: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the module PEFT names ``key`` (``model.layers.0.mlp.experts.gate_up_proj``):
    the config's, or its ``rank_pattern`` / ``alpha_pattern`` entries' (served on the experts only)."""
    rank, alpha = cfg["r"], cfg["lora_alpha"]
    for name in ("rank_pattern", "alpha_pattern"):
        found = _pattern(path, cfg, name, key)
        if found is None:
            continue
        pattern, value = found
        if module not in EXPERT_MODULES:
            raise _refuse(path, f"{name} {pattern!r} on {module} is not supported (only on the experts' "
                                "parameters, as PEFT's conversion of MoE targets writes it)")
        ok = (isinstance(value, int) and value >= 1) if name == "rank_pattern" else \
            (isinstance(value, (int, float)) and math.isfinite(value))
        if isinstance(value, bool) or not ok:
            what = "rank" if name == "rank_pattern" else "number"
            raise _refuse(path, f"{name} {pattern!r}: {value!r} is not a {what}")
        if name == "rank_pattern":
            rank = value
        else:
            alpha = value
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} of {module} exceeds --max-lora-rank {max_rank}")
    return rank, float(alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank)


def _header(path: Path) -> tuple[dict, int]:
    """The safetensors header of the weights file, and the file's size: every tensor's bytes
    must lie inside the file, so a truncated download is refused here, not at load."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        alt = " (adapter_model.bin is a pickle: not read; save with safe_serialization)" \
            if (path / "adapter_model.bin").exists() else ""
        raise _refuse(path, f"no {WEIGHTS_FILE}{alt}")
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _refuse(path, f"{WEIGHTS_FILE} is truncated (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER_BYTES, size - 8):
                raise _refuse(path, f"{WEIGHTS_FILE} is corrupt (header of {n} bytes in a {size}-byte file)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(path, f"{WEIGHTS_FILE} has an unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise _refuse(path, f"{WEIGHTS_FILE} has a header that is not a JSON object")
    header.pop("__metadata__", None)
    return header, size - 8 - n


def _tensors(path: Path, header: dict, data_bytes: int, targeted: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """(layer, module, side) -> (dtype, shape) and -> its name; (layer, module) -> the name PEFT gives
    the module it adapts (``model.layers.0.mlp.experts.gate_up_proj``: what rank_pattern matches)."""
    tensors, names, keys = {}, {}, {}
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise _refuse(path, f"tensor {name}: dtype {info.get('dtype') if isinstance(info, dict) else info!r} "
                                f"is not one of {', '.join(_SAFETENSORS_DTYPES)}")
        shape, offsets = tuple(info.get("shape", ())), info.get("data_offsets", ())
        expected = math.prod(shape) * _SAFETENSORS_DTYPES[info["dtype"]]
        if len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1] <= data_bytes \
                or offsets[1] - offsets[0] != expected:
            raise _refuse(path, f"{WEIGHTS_FILE} is truncated or corrupt (tensor {name})")
        if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
            raise _refuse(path, f"adapters on embeddings or lm_head are not supported ({name})")
        match = _TENSOR.search(name)
        if match is None:
            raise _refuse(path, f"tensor {name} is not a LoRA A/B weight of a decoder layer's projection")
        layer, _, where, side = match.groups()
        module = _module(path, name, where, targeted)
        if len(shape) != 2:
            raise _refuse(path, f"tensor {name} has shape {list(shape)}, not a matrix")
        key = (int(layer), module, side)
        tensors[key], names[key] = (info["dtype"], shape), name
        keys[(int(layer), module)] = name[:match.start(3)].removeprefix("base_model.model.") + module
    if not tensors:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    for layer, module, side in tensors:
        if (layer, module, "B" if side == "A" else "A") not in tensors:
            raise _refuse(path, f"layer {layer} {module} has lora_{side} but not its pair")
    return tensors, names, keys


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with open(path / file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_adapter(path: str, max_rank: int, projections: Optional[dict[str, tuple[int, int]]] = None,
                 num_layers: Optional[int] = None, num_experts: Optional[int] = None) -> AdapterSpec:
    """Read and judge the adapter at ``path``; raises LoRAAdapterError naming the reason.

    ``projections`` (module -> (in, out) of the base model, unsharded; ``projection_shapes``;
    an expert module's per expert), ``num_layers`` and ``num_experts`` (``expert_count``), when
    given, check the tensors' shapes against the model they adapt.
    """
    where = Path(path).expanduser()
    if not where.is_dir():
        raise _refuse(where, "not a directory" if where.exists() else "does not exist")
    where = where.resolve()
    cfg = _config(where)
    _, scaling = _check_config(where, cfg, max_rank)
    targeted = expert_parameters(where, cfg)
    header, data_bytes = _header(where)
    tensors, names, keys = _tensors(where, header, data_bytes, targeted)
    settings = {(layer, module): _module_settings(where, cfg, key, module, max_rank)
                for (layer, module), key in keys.items()}
    for (layer, module, side), (_, shape) in tensors.items():
        if num_layers is not None and layer >= num_layers:
            raise _refuse(where, f"layer {layer} does not exist in the base model ({num_layers} layers)")
        if projections is not None and module not in projections:
            raise _refuse(where, f"module {module!r} is not a projection of this model "
                                 f"(it has {', '.join(sorted(projections))})")
        want_r, module_rank = shape[0] if side == "A" else shape[1], settings[(layer, module)][0]
        if module in EXPERT_MODULES:
            _check_experts(where, layer, module, side, want_r, module_rank, num_experts,
                           tensors[(layer, module, "B" if side == "A" else "A")][1])
        elif want_r != module_rank:
            raise _refuse(where, f"layer {layer} {module} lora_{side} has rank {want_r}, "
                                 f"the config says r={module_rank}")
        if projections is not None:
            d_in, d_out = projections[module]
            if (side == "A" and shape[1] != d_in) or (side == "B" and shape[0] != d_out):
                raise _refuse(where, f"layer {layer} {module} lora_{side} has shape {list(shape)}, "
                                     f"which does not fit the base model's {d_in} -> {d_out} projection")
    return AdapterSpec(str(where), max(r for r, _ in settings.values()), scaling,
                       tuple(sorted({m for _, m, _ in tensors})), 1 + max(layer for layer, _, _ in tensors), tensors,
                       names, _digest(where), settings)


def _check_experts(path: Path, layer: int, module: str, side: str, rows: int, rank: int,
                   num_experts: Optional[int], pair: tuple[int, ...]) -> None:
    """An expert module's A rows (B columns) are r per expert, and its pair's match them."""
    if rows % rank or rows != (pair[1] if side == "A" else pair[0]):
        raise _refuse(path, f"layer {layer} {module} lora_{side} has {rows} rank rows, not r={rank} for each "
                            "expert as its pair's")
    if num_experts is not None and rows != rank * num_experts:
        raise _refuse(path, f"layer {layer} {module} lora_{side} has {rows // rank} experts of r={rank}; "
                            f"the base model has {num_experts}")


def _moe_sizes(text: dict) -> tuple[int, int, int]:
    """(routed experts, each one's intermediate size, the shared expert's) of a config's text part:
    Mixtral's and gpt-oss's names, or Qwen-MoE's."""
    experts = int(text.get("num_local_experts") or text.get("num_experts") or 0)
    inter = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0)
    return experts, inter, int(text.get("shared_expert_intermediate_size") or 0)


def expert_count(model_cfg: dict) -> int:
    """The routed experts of each sparse layer of ``model_cfg`` (0: a dense model)."""
    return _moe_sizes(model_cfg.get("text_config") or model_cfg)[0]


def projection_shapes(model_cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable projection of a decoder of ``model_cfg`` (a config.json dict);
    of a routed expert's one expert."""
    text = model_cfg.get("text_config") or model_cfg
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    inter = int(text.get("intermediate_size") or 4 * hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    if "Phi3" in "".join(model_cfg.get("architectures") or ()):
        shapes = {"qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden),
                  "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
    experts, expert_inter, shared = _moe_sizes(text)
    if experts and not text.get("mlp_only_layers") and int(text.get("decoder_sparse_step") or 1) == 1:
        # every layer's MLP is the experts' block: no dense gate/up/down to adapt
        shapes = {m: shape for m, shape in shapes.items() if m not in MLP_MODULES}
    if experts:
        shapes.update({"experts.gate_up_proj": (hidden, 2 * expert_inter), "experts.down_proj": (expert_inter, hidden)})
    if shared:
        shapes.update({"shared_expert.gate_proj": (hidden, shared), "shared_expert.up_proj": (hidden, shared),
                       "shared_expert.down_proj": (shared, hidden)})
    return shapes
