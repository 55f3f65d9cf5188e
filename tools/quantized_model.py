"""Quantized random model directories in compressed-tensors' format, made by the library itself.

A model from ``demo_model.build_model_dir`` is quantized by round to nearest (min / max of each
group, channel or tensor, ``compressed_tensors``' own ``calculate_qparams``), then compressed and
saved by ``compressed_tensors``' ``ModelCompressor`` exactly as llm-compressor saves a checkpoint:
``weight_packed`` (pack-quantized) or an int8 ``weight`` (int-quantized), ``weight_scale``,
``weight_zero_point`` when asymmetric, and ``quantization_config`` in config.json. The FP8 presets
(``FLOAT8_PRESETS``) store a float8_e4m3fn ``weight`` (float-quantized), the static one an ``input_scale`` per
layer from the largest input a forward of random tokens gives it. lm_head stays
in float, as llm-compressor's recipes usually leave it (``ignore: ["lm_head"]``), unless
``quantize_lm_head`` asks for the recipe without that line, which quantizes it too. transformers
loads the result (it decompresses it), which is the oracle of the engine's quantized paths.
transformers 5.25 cannot load an asymmetric pack-quantized file (its zero points are packed down
the rows, and the loader expects them unpacked), so ``dequantized_model_dir`` writes the float
model the library's own decompressor makes of a file, for transformers to load instead. Needs the
``compressed-tensors`` package.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from pagedserve.tools.demo_model import build_model_dir

# name -> (weight bits, group size or None for per channel, symmetric, activations per token)
SCHEMES: dict[str, tuple[int, Optional[int], bool, bool]] = {
    "w8a16": (8, None, True, False),  # per output channel: torch's int8 weight-only op takes it whole
    "w8a16_g128": (8, 128, True, False),  # compressed-tensors' W8A16 preset
    "w4a16": (4, 128, True, False),  # the W4A16 preset
    "w4a16_asym": (4, 128, False, False),  # W4A16_ASYM
    "w8a16_asym": (8, None, False, False),  # asymmetric per channel
    "w8a8": (8, None, True, True),  # the W8A8 / INT8 preset: dynamic per-token activations
}
# name -> compressed-tensors' float8 preset: float8_e4m3fn weights per channel with activations per token
# (dynamic), or per tensor with static activation scales (``input_scale``, calibrated on random tokens)
FLOAT8_PRESETS = {"fp8_dynamic": "FP8_DYNAMIC", "fp8": "FP8"}


def quantization_config(scheme: str, quantize_lm_head: bool = False) -> Any:
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 preset_name_to_scheme)

    ignore = [] if quantize_lm_head else ["lm_head"]
    if scheme in FLOAT8_PRESETS:
        return QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(FLOAT8_PRESETS[scheme], ["Linear"])},
                                  ignore=ignore)
    bits, group, symmetric, dynamic = SCHEMES[scheme]
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, group_size=group,
                               strategy="group" if group else "channel", dynamic=False)
    activations = (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
                   if dynamic else None)
    return QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                     input_activations=activations)},
        ignore=ignore)


def _round_to_nearest(model: Any) -> None:
    """Each quantized Linear's scale (and zero point) from its weight's min / max per group."""
    import torch
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, weight = scheme.weights, module.weight.detach().float()
        rows, cols = weight.shape
        grouped = (weight.reshape(rows, cols // args.group_size, args.group_size) if args.group_size else
                   weight.reshape(1, 1, -1) if args.strategy == "tensor" else weight.reshape(rows, 1, cols))
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        with torch.no_grad():
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                zero_point = zero_point.reshape(module.weight_zero_point.shape)
                module.weight_zero_point.copy_((zero_point.round() if args.type == "int" else zero_point)
                                               .to(module.weight_zero_point.dtype))
        module.quantization_status = QuantizationStatus.FROZEN


def _input_max(model: Any, tokens: int = 64) -> dict:
    """max |input| of each Linear over a forward of random tokens: a static scheme's calibration."""
    import torch

    seen: dict = {}
    hooks = [module.register_forward_pre_hook(
        lambda m, args, name=name: seen.__setitem__(name, max(seen.get(name, 0.0), args[0].abs().max().item())))
        for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    return seen


def _static_input_scales(model: Any, input_max: dict) -> None:
    """Each quantized Linear's ``input_scale`` from its calibrated max |input| (compressed-tensors' qparams)."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.input_activations is None or scheme.input_activations.dynamic:
            continue
        top = torch.tensor([input_max[name]])
        scale, _ = calculate_qparams(-top, top, scheme.input_activations)
        with torch.no_grad():
            module.input_scale.copy_(scale.reshape(module.input_scale.shape).to(module.input_scale.dtype))


def build_quantized_model_dir(path: str | Path, scheme: str = "w4a16", arch: str = "llama",
                              quantize_lm_head: bool = False, **model_kwargs: Any) -> Path:
    """A random ``arch`` model (``demo_model.build_model_dir``'s arguments; the defaults give
    every projection 128 or 256 inputs, whole groups of 128) quantized by ``scheme`` (SCHEMES),
    lm_head too with ``quantize_lm_head``, saved compressed into ``path``; returns it."""
    path = Path(path)
    kwargs = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256) | model_kwargs
    source = build_model_dir(path.with_name(path.name + "-float"), arch, **kwargs)
    quantize_model_dir(source, path, scheme, quantize_lm_head)
    shutil.rmtree(source)
    return path


def quantize_model_dir(source: str | Path, path: str | Path, scheme: str, quantize_lm_head: bool = False) -> Path:
    """``source`` (a float model directory) quantized by ``scheme`` (lm_head too with ``quantize_lm_head``)
    into ``path``; returns it."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    source, path = Path(source), Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    input_max = _input_max(model) if scheme == "fp8" else {}
    apply_quantization_config(model, quantization_config(scheme, quantize_lm_head))
    _round_to_nearest(model)
    _static_input_scales(model, input_max)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path, safe_serialization=True)
    compressor.update_config(str(path))
    for file in source.iterdir():  # tokenizer, generation config, demo marker
        if not (path / file.name).exists():
            shutil.copy(file, path / file.name)
    return path


def dequantized_model_dir(quantized: str | Path, path: str | Path) -> Path:
    """The float32 model compressed-tensors' decompressor makes of ``quantized`` (its
    ``weight_packed`` / int8 ``weight``, scales and zero points -> ``weight``), without a
    quantization_config, in ``path``; returns it."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    quantized, path = Path(quantized), Path(path)
    config = json.loads((quantized / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config.pop("quantization_config"))
    scheme = next(iter(qc.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    tensors = load_file(str(quantized / "model.safetensors"))
    prefixes = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    out = {name: t for name, t in tensors.items() if name.rsplit(".", 1)[0] not in prefixes}
    for prefix in sorted(prefixes):
        local = {name.rsplit(".", 1)[1]: t for name, t in tensors.items() if name.rsplit(".", 1)[0] == prefix}
        out[prefix + ".weight"] = compressor.decompress(local, scheme)["weight"].to(torch.float32).contiguous()
    return save_model_dir(path, out, config, quantized)


def save_model_dir(path: Path, tensors: dict, config: dict, beside: Path) -> Path:
    """``tensors`` and ``config`` as a model directory in ``path``, with ``beside``'s other files (tokenizer,
    generation config, demo marker); returns it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for file in beside.iterdir():
        if not (path / file.name).exists():
            shutil.copy(file, path / file.name)
    return path
