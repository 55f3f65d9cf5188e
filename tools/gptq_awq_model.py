"""GPTQ and AWQ checkpoints of the demo models, packed in each format's exact layout without the libraries.

Neither GPTQModel nor AutoAWQ installs here (GPTQModel needs a newer torch, datasets, torchao, ...; AutoAWQ
is archived), so each projection of a float model directory (``demo_model.build_model_dir``) is quantized by
round to nearest (min / max of each group, fp16 scales as both libraries save them) and its integers packed
as the libraries write them:

- GPTQ (AutoGPTQ's ``QuantLinear.pack``): ``qweight`` [in / (32 / bits), out] int32, ``32 / bits``
  consecutive inputs a word from the lowest bits; ``qzeros`` [groups, out / (32 / bits)] the zero points
  packed along the outputs, less one in ``checkpoint_format: gptq`` (v1), as is in ``gptq_v2``; ``scales``
  [groups, out] fp16; ``g_idx`` [in] int32. ``desc_act``: the groups are taken over a random order of the
  inputs (one order for the projections that read the same inputs, as GPTQ's Hessian order is), so g_idx
  is no longer ``i // group_size``. Symmetric weights have the midpoint zero point, as GPTQ stores them.
- AWQ (AutoAWQ's ``WQLinear_GEMM.from_linear``): ``qweight`` [in, out / 8] int32, 8 outputs a word in the
  nibble order [0, 2, 4, 6, 1, 3, 5, 7]; ``qzeros`` [groups, out / 8] the same; ``scales`` [groups, out] fp16.

tests/support/gptq_awq_reference.py unpacks them by the libraries' own dequantize code (transcribed there),
which is how the tests hold this writer and the engine's reader to the formats.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from pagedserve.tools.demo_model import build_model_dir
from pagedserve.tools.quantized_model import save_model_dir

PROJECTIONS = {  # the checkpoint name of each projection -> the inputs it reads (one desc_act order each)
    "self_attn.q_proj": "attention", "self_attn.k_proj": "attention", "self_attn.v_proj": "attention",
    "self_attn.o_proj": "o_proj", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down_proj",
}
AWQ_NIBBLE_OUTPUTS = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's AWQ_ORDER: the output in each nibble, lowest first


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str,
                lm_head: bool = False) -> dict:
    """config.json's quantization_config as GPTQModel writes it (the fields that change the tensors' reading)."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": checkpoint_format, "lm_head": lm_head, "static_groups": False,
            "true_sequential": True, "damp_percent": 0.01, "pack_dtype": "int32"}


def awq_config(group_size: int) -> dict:
    """config.json's quantization_config as AutoAWQ writes it."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def round_to_nearest(weight: Any, bits: int, group_size: Optional[int], sym: bool, order: Any,
                     min_zero: int = 0) -> tuple[Any, Any, Any]:
    """(unsigned ints [out, in], fp16 scales [out, groups], zero points [out, groups]) of ``weight`` [out, in],
    its groups taken over the inputs in ``order``; ``min_zero``: the smallest zero point the format stores."""
    import torch

    maxq = (1 << bits) - 1
    n, k = weight.shape
    g = group_size or k
    blocks = weight.float()[:, order].reshape(n, k // g, g)
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    if sym:
        scale = torch.maximum(-lo, hi) * 2 / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).half().float()
    if not sym:
        zero = torch.round(-lo / scale).clamp(min_zero, maxq)
    q = (torch.round(blocks / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, maxq).reshape(n, k)
    unsigned = torch.empty_like(q, dtype=torch.int64)
    unsigned[:, order] = q.to(torch.int64)
    return unsigned, scale.half(), zero.to(torch.int64)


def _to_int32(words: Any) -> Any:
    """int64 words of 32 bits -> int32 (two's complement, as the libraries' int32 shifts leave them)."""
    import torch

    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(values: Any, bits: int) -> Any:
    """[rows, cols] unsigned -> [rows / (32 / bits), cols] int32: consecutive rows in a word, lowest bits first."""
    per_word = 32 // bits
    rows, cols = values.shape
    parts = values.reshape(rows // per_word, per_word, cols)
    return _to_int32(sum(parts[:, j] << (bits * j) for j in range(per_word)))


def pack_columns(values: Any, bits: int, order: tuple[int, ...] = ()) -> Any:
    """[rows, cols] unsigned -> [rows, cols / (32 / bits)] int32: consecutive columns in a word, lowest bits
    first, or column ``order[j]`` of each word's run in its j-th place."""
    per_word = 32 // bits
    rows, cols = values.shape
    parts = values.reshape(rows, cols // per_word, per_word)
    order = order or tuple(range(per_word))
    return _to_int32(sum(parts[:, :, order[j]] << (bits * j) for j in range(per_word)))


def pack_gptq(unsigned: Any, scale: Any, zero: Any, g_idx: Any, bits: int, checkpoint_format: str) -> dict:
    """One projection's GPTQ tensors from [out, in] unsigned ints and [out, groups] scales / zero points."""
    import torch

    stored = zero - 1 if checkpoint_format == "gptq" else zero
    return {"qweight": pack_rows(unsigned.t().contiguous(), bits),
            "qzeros": pack_columns(stored.t().contiguous(), bits),
            "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def pack_awq(unsigned: Any, scale: Any, zero: Any) -> dict:
    """One projection's AWQ GEMM tensors from [out, in] unsigned ints and [out, groups] scales / zero points."""
    return {"qweight": pack_columns(unsigned.t().contiguous(), 4, AWQ_NIBBLE_OUTPUTS),
            "qzeros": pack_columns(zero.t().contiguous(), 4, AWQ_NIBBLE_OUTPUTS),
            "scales": scale.t().contiguous()}


def quantize_model_dir(source: str | Path, path: str | Path, method: str, bits: int = 4,
                       group_size: Optional[int] = 128, sym: bool = True, desc_act: bool = False,
                       checkpoint_format: str = "gptq", seed: int = 0, lm_head: bool = False) -> Path:
    """``source`` (a float model directory) as a ``method`` ("gptq" or "awq") checkpoint in ``path``; the
    embeddings, norms, biases and lm_head stay float (lm_head is quantized too with ``lm_head``, GPTQModel's
    ``lm_head: true``; an untied one). ``group_size`` None: one group a row (-1)."""
    import torch
    from safetensors.torch import load_file

    source, path = Path(source), Path(path)
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    out, orders = {}, {}
    for name, tensor in tensors.items():
        stem, _, kind = name.rpartition(".")
        layer, _, projection = stem.partition(".layers.")[2].partition(".")
        quantized_head = lm_head and method == "gptq" and stem == "lm_head"
        if kind != "weight" or (projection not in PROJECTIONS and not quantized_head):
            out[name] = tensor
            continue
        k = tensor.shape[1]
        key = ("", "lm_head") if quantized_head else (layer, PROJECTIONS[projection])
        if key not in orders:
            orders[key] = torch.randperm(k, generator=generator) if desc_act else torch.arange(k)
        order = orders[key]
        min_zero = 1 if method == "gptq" and checkpoint_format == "gptq" else 0  # v1 stores zero - 1 unsigned
        unsigned, scale, zero = round_to_nearest(tensor, bits, group_size, sym and method == "gptq", order,
                                                 min_zero)
        if method == "gptq":
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // (group_size or k)
            packed = pack_gptq(unsigned, scale, zero, g_idx, bits, checkpoint_format)
        else:
            packed = pack_awq(unsigned, scale, zero)
        out.update({f"{stem}.{part}": t for part, t in packed.items()})
    config = json.loads((source / "config.json").read_text())
    if lm_head and "lm_head.weight" not in tensors:
        raise ValueError("lm_head: the model ties lm_head to its embeddings (no lm_head.weight to quantize)")
    config["quantization_config"] = (gptq_config(bits, group_size or -1, sym, desc_act, checkpoint_format, lm_head)
                                     if method == "gptq" else awq_config(group_size or -1))
    return save_model_dir(path, out, config, source)


def build_gptq_awq_model_dir(path: str | Path, method: str = "gptq", arch: str = "qwen2", *, bits: int = 4,
                             group_size: Optional[int] = 128, sym: bool = True, desc_act: bool = False,
                             checkpoint_format: str = "gptq", lm_head: bool = False, **model_kwargs: Any) -> Path:
    """A random ``arch`` model (``demo_model.build_model_dir``'s arguments; the defaults give every
    projection 128 or 256 inputs, whole groups of 128) as a ``method`` checkpoint in ``path``; returns it."""
    path = Path(path)
    kwargs = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256) | model_kwargs
    source = build_model_dir(path.with_name(path.name + "-float"), arch, **kwargs)
    quantize_model_dir(source, path, method, bits, group_size, sym, desc_act, checkpoint_format,
                       seed=kwargs.get("seed", 0), lm_head=lm_head)
    shutil.rmtree(source)
    return path
