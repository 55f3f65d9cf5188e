"""GPTQ's and AWQ's own dequantization, transcribed from the libraries that define the formats, and the
float32 model directory they make of a checkpoint: transformers runs that directory as the oracle of the
engine's GPTQ / AWQ paths (transformers itself loads these formats only through gptqmodel / autoawq,
which do not install here). Independent of the engine's reader and of tools/gptq_awq_model.py's writer:
the unpacking below follows the published code step by step, only the final product is taken in
float32 (the libraries multiply in the scales' fp16; the engine, like this oracle, in float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedserve.tools.quantized_model import save_model_dir


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, checkpoint_format: str) -> torch.Tensor:
    """The float32 weight [out, in] of one GPTQ projection.

    Transcribed from AutoGPTQ, auto_gptq/nn_modules/qlinear/qlinear_cuda.py (github.com/AutoGPTQ/AutoGPTQ,
    commit 9f7d370), ``QuantLinear.forward``'s torch path for 2/4/8 bits: zeros unpacked by
    ``bitwise_right_shift`` of ``qzeros`` by ``wf`` = range(0, 32, bits), cast to int8 (int16 for 8 bits),
    masked, then ``zeros + 1``; the weight unpacked the same way along the rows of ``qweight``; the
    weight ``scales[g_idx] * (weight - zeros[g_idx])``. ``gptq_v2`` keeps the zeros as stored
    (GPTQModel, gptqmodel/nn_modules/qlinear/__init__.py, ``PackableQuantLinear.dequantize_weight``, which
    reads format-2 zeros without the + 1).
    """
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    small = torch.int16 if bits == 8 else torch.int8
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits),
                                      wf.unsqueeze(0)).to(small)
    zeros = torch.bitwise_and(zeros, (2 ** bits) - 1)
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1),
                                       wf.unsqueeze(-1)).to(small)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.long()
    weights = scales.float()[g] * (weight - zeros[g]).float()
    return weights.t().contiguous()


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                   group_size: int) -> torch.Tensor:
    """The float32 weight [out, in] of one AWQ GEMM projection.

    Transcribed from AutoAWQ, awq/utils/packing_utils.py (github.com/casper-hansen/AutoAWQ, commit 88e4c76):
    ``unpack_awq`` (right shifts by range(0, 32, bits) along each row's words, cast to int8),
    ``reverse_awq_order`` (each word's values taken in AWQ_REVERSE_ORDER), the "overflow checks" masks,
    then ``dequantize_gemm``'s ``(iweight - izeros) * scales`` with scales and zeros repeated over each group.
    """
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse_order_tensor = torch.arange(iweights.shape[-1], dtype=torch.int32)
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER].view(-1)
    izeros, iweights = izeros[:, reverse_order_tensor], iweights[:, reverse_order_tensor]
    iweights = torch.bitwise_and(iweights, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    scales = scales.float().repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweights - izeros).float() * scales).t().contiguous()


def dequantize(tensors: dict[str, torch.Tensor], prefix: str, quantization_config: dict) -> torch.Tensor:
    """The float32 weight of ``prefix`` in a GPTQ or AWQ checkpoint's ``tensors``."""
    qc, t = quantization_config, {name: tensors[f"{prefix}.{name}"] for name in ("qweight", "qzeros", "scales")}
    if qc["quant_method"] == "gptq":
        return gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], tensors[f"{prefix}.g_idx"], qc["bits"],
                               qc.get("checkpoint_format", "gptq"))
    k = t["qweight"].shape[0]
    return awq_dequantize(t["qweight"], t["qzeros"], t["scales"], qc["bits"],
                          k if qc["group_size"] == -1 else qc["group_size"])


def dequantized_model_dir(quantized: str | Path, path: str | Path) -> Path:
    """The float32 model these references make of a GPTQ / AWQ directory (``weight`` for each ``qweight``,
    no quantization_config), in ``path``; returns it."""
    from safetensors.torch import load_file

    quantized, path = Path(quantized), Path(path)
    config = json.loads((quantized / "config.json").read_text())
    qc = config.pop("quantization_config")
    tensors = load_file(str(quantized / "model.safetensors"))
    prefixes = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".qweight")}
    out = {name: t for name, t in tensors.items() if name.rsplit(".", 1)[0] not in prefixes}
    out.update({prefix + ".weight": dequantize(tensors, prefix, qc) for prefix in sorted(prefixes)})
    out.update({name: t for name, t in tensors.items() if name.endswith(".bias")})
    return save_model_dir(path, out, config, quantized)
