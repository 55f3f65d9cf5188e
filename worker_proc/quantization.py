"""Loads a quantized checkpoint's projections as quantized layers (models/quantized_linear.py): a
compressed-tensors checkpoint's read here, GPTQ's and AWQ's by gptq_awq_weights.py, a GGUF's by gguf_weights.py.

A layer is quantized when the checkpoint holds its ``weight_packed`` (pack-quantized: the signed
integers + 2^(bits-1), packed little-endian from bit 0 of each int32 word, a zero point packed the
same way down the output rows) or an int8 ``weight`` (int-quantized, naive-quantized), with
``weight_scale`` [out, in / group] (or [out, 1] per channel); a layer ``ignore``d by the config keeps
its float ``weight`` and the float path. The integers are unpacked to int8 once, sliced for this
tensor-parallel rank (output rows of q/k/v and gate/up, inputs of o_proj and down_proj, whole groups
and packed words only), fused (q|k|v, gate|up) and handed to the op's builder; no float copy of an
integer weight is ever made. An FP8 checkpoint's float8_e4m3fn ``weight`` (float-quantized, a scale per channel or
per tensor, a static scheme's ``input_scale``) is widened and dequantized at load instead (models/fp8_linear.py:
CPUs have no float8 arithmetic). Anything that does not fit (a shape that does not divide into its
groups, a scale of the wrong shape, a fused group half quantized) raises UnsupportedModelError in
one line naming the tensor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from pagedserve.protocol.quantization import (PACKED, QuantizationConfigError, QuantizationSpec, gpu_serves,
                                              parse_quantization_config)
from pagedserve.worker_proc.gptq_awq_weights import packed_reader
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.models.linear import LinearWeight, WeightLayout
from pagedserve.worker_proc.models.fp8_linear import make_fp8
from pagedserve.worker_proc.models.quantized_linear import (QuantizedStack, make_gpu_int, make_int4, make_int8,
                                                            make_w8a8)
from pagedserve.worker_proc.tensor_parallel import TensorParallelShard

Part = Optional[tuple[int, int]]


def checkpoint_quantization(model_dir: str | Path, requested: Optional[str] = None) -> Optional[QuantizationSpec]:
    """config.json's scheme, ``--quantization`` checked against it (UnsupportedModelError, one line)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
        return parse_quantization_config(config, requested)
    except QuantizationConfigError as exc:
        raise UnsupportedModelError(str(exc)) from None


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, count] int8 signed values (pack_to_int32's inverse for 4 / 8 bits)."""
    if sys.byteorder != "little":
        raise UnsupportedModelError("pack-quantized weights are read on little-endian hosts only")
    raw = packed.contiguous().view(torch.uint8)
    if bits == 8:
        return (raw[:, :count] ^ 0x80).view(torch.int8).contiguous()
    nibbles = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)[:, :count]
    return (nibbles.view(torch.int8) - 8).contiguous()


class _Reader:
    mixed_as_float = False  # one scheme for the whole model: a fused projection half quantized is refused
    mixed_as_stack = False

    def __init__(self, source, spec: QuantizationSpec):
        self.source, self.spec = source, spec

    def spec_of(self, prefix: str) -> Optional[QuantizationSpec]:
        return self.spec if self.is_quantized(prefix) else None

    def is_quantized(self, prefix: str) -> bool:
        if prefix + ".weight_packed" in self.source:
            return True
        stored = "F8_E4M3" if self.spec.float8 else "I8"
        return prefix + ".weight" in self.source and self.source.dtype_name(prefix + ".weight") == stored

    def input_scale(self, prefix: str) -> torch.Tensor:
        """A static activation scheme's scale of ``prefix``'s input (one, per tensor)."""
        if prefix + ".input_scale" not in self.source:
            raise UnsupportedModelError(f"{prefix}.input_scale is missing (the scheme's activations are static)")
        scale = self.source.get(prefix + ".input_scale")
        if scale.numel() != 1:
            raise UnsupportedModelError(f"{prefix}.input_scale has shape {list(scale.shape)}, not one per tensor")
        return scale.reshape(()).float()

    def _values(self, prefix: str, dim: int, part: Part) -> tuple[torch.Tensor, int, int]:
        """(int8 values of this slice, out, in of the whole weight)."""
        spec, src = self.spec, self.source
        if prefix + ".weight_packed" in src:
            if spec.format != PACKED:
                raise UnsupportedModelError(f"{prefix}.weight_packed in a {spec.format} checkpoint")
            shape = src.get(prefix + ".weight_shape")
            if shape.numel() != 2:
                raise UnsupportedModelError(f"{prefix}.weight_shape {shape.tolist()} is not [out, in]")
            n, k = (int(v) for v in shape.tolist())
            per_word = 32 // spec.bits
            words = src.shape(prefix + ".weight_packed")[-1]
            if words != -(-k // per_word):
                raise UnsupportedModelError(f"{prefix}.weight_packed has {words} words a row, not the "
                                            f"{-(-k // per_word)} of {k} {spec.bits}-bit values")
            if dim == 1 and part is not None:
                start, end = part
                if start % per_word or end % per_word:
                    raise UnsupportedModelError(f"{prefix}: this rank's inputs [{start}, {end}) cut a packed word")
                packed = src.get(prefix + ".weight_packed", dim=1, part=(start // per_word, end // per_word))
                return _unpack(packed, spec.bits, end - start), n, k
            q = _unpack(src.get(prefix + ".weight_packed", dim=0, part=part), spec.bits, k)
            return q, n, k
        shape = src.shape(prefix + ".weight")
        if len(shape) != 2:
            raise UnsupportedModelError(f"{prefix}.weight has shape {shape}, not [out, in]")
        return src.get(prefix + ".weight", dim=dim, part=part), shape[0], shape[1]

    def read(self, prefix: str, dim: int,
             part: Part) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], None]:
        """(int8 values [rows, in], scale [rows, groups], zero point [rows, groups] or None, no mins) of this slice
        (a reader's fourth part, mins [rows, groups], is subtracted after the scale: only a GGUF's Q4_K has them)."""
        spec, src, group = self.spec, self.source, self.spec.group_size
        q, n, k = self._values(prefix, dim, part)
        if group is not None and k % group:
            raise UnsupportedModelError(f"{prefix} has {k} inputs, not a multiple of group_size {group}")
        groups = k // group if group else 1
        scale = src.get(prefix + ".weight_scale")
        if spec.float8:  # float8 values widened to float32 (exact); a per-tensor scale given to every row
            q = q.float()
            if scale.numel() == 1:
                scale = scale.float().reshape(1, 1).expand(n, 1)
        if tuple(scale.shape) != (n, groups):
            raise UnsupportedModelError(f"{prefix}.weight_scale has shape {list(scale.shape)}, not [{n}, {groups}]")
        zero = None
        if not spec.symmetric:
            zero = src.get(prefix + ".weight_zero_point")
            if spec.format == PACKED:
                zero = _unpack(zero.t(), spec.bits, n).t()
            if tuple(zero.shape) != (n, groups):
                raise UnsupportedModelError(f"{prefix}.weight_zero_point has shape {list(zero.shape)}, "
                                            f"not [{n}, {groups}]")
        if part is not None:
            start, end = part
            if dim == 0:
                scale, zero = scale[start:end], None if zero is None else zero[start:end]
            elif group is not None:
                if start % group or end % group:
                    raise UnsupportedModelError(f"{prefix}: this rank's inputs [{start}, {end}) cut a group of {group}")
                cols = slice(start // group, end // group)
                scale, zero = scale[:, cols], None if zero is None else zero[:, cols]
        return q, scale.contiguous(), None if zero is None else zero.contiguous(), None


def _reader_of(source):
    """What reads ``source``'s quantized projections: a GGUF's own (a type per tensor), or config.json's
    method's (GPTQ's and AWQ's in gptq_awq_weights.py, compressed-tensors' here)."""
    own = getattr(source, "quantized_reader", None)
    if own is not None:
        return own
    spec: Optional[QuantizationSpec] = getattr(source, "quantization", None)
    return None if spec is None else packed_reader(source, spec) or _Reader(source, spec)


def stored_quantized(source, prefix: str) -> Optional[QuantizationSpec]:
    """The scheme ``prefix``'s weight is stored in (None: float), as its reader sees the tensors."""
    reader = _reader_of(source)
    return None if reader is None else reader.spec_of(prefix)


def _input_order(reader, prefixes: list[str], dim: int, parts: list[Part]) -> Optional[torch.Tensor]:
    """The one order a fused projection's layer reads its inputs in (GPTQ's activation order), or None."""
    if not hasattr(reader, "input_order"):
        return None
    orders = [reader.input_order(p, dim, pt) for p, pt in zip(prefixes, parts)]
    first = orders[0]
    if not all(o is first or (o is not None and first is not None and torch.equal(o, first)) for o in orders):
        names = ", ".join(p.rsplit(".", 1)[-1] for p in prefixes)
        raise UnsupportedModelError(f"{prefixes[0].rsplit('.', 1)[0]}: {names} order their inputs differently "
                                    f"(g_idx), so they cannot be fused into one layer")
    return orders[0]


def load_projection(source, prefixes: list[str], dim: int, parts: list[Part],
                    load: Callable[[torch.Tensor], torch.Tensor], bias: Optional[torch.Tensor], layout: WeightLayout,
                    dtype: torch.dtype, device: torch.device, gate_size: int = 0,
                    shard: Optional[TensorParallelShard] = None) -> LinearWeight:
    """One (fused) projection: ``prefixes`` (q, k, v or gate, up, or a single one) stacked on their
    output rows, each sliced along ``dim`` by its entry of ``parts``. Float weights take
    ``LinearWeight.of``; quantized ones a QuantizedLinear of their scheme. ``shard``: the ranks whose slices of
    x a row-parallel layer (``dim`` 1) sees, where a scheme scales x by its whole rows (FP8 per token)."""
    reader = _reader_of(source)
    specs = [None if reader is None else reader.spec_of(p) for p in prefixes]
    if all(specs) and len(set(specs)) > 1 and reader.mixed_as_stack:  # a GGUF's parts of different quantized types
        layers = [load_projection(source, [p], dim, [pt], load, None, layout, dtype, device).quantized
                  for p, pt in zip(prefixes, parts)]
        return LinearWeight(None, bias, out_features=sum(layer.out_features for layer in layers), gate_size=gate_size,
                            quantized=QuantizedStack(tuple(layers)))
    if any(specs) and len(set(specs)) > 1 and reader.mixed_as_float:
        specs = [None] * len(prefixes)  # a GGUF's parts of a float type beside a quantized one: all read in float
    if not any(specs):
        tensors = [source.get(p + ".weight", dim=dim, part=pt) for p, pt in zip(prefixes, parts)]
        weight = load(tensors[0] if len(tensors) == 1 else torch.cat(tensors))
        return LinearWeight.of(weight, bias, layout, gate_size=gate_size)
    if not all(specs):
        mixed = ", ".join(f"{p.rsplit('.', 1)[-1]} {'quantized' if q else 'float'}" for p, q in zip(prefixes, specs))
        raise UnsupportedModelError(f"{prefixes[0].rsplit('.', 1)[0]}: a fused projection mixes quantized and "
                                    f"float weights ({mixed})")
    spec = specs[0]
    gpu = device.type != "cpu"
    if gpu and not (spec.float8 or gpu_serves(spec)):
        raise UnsupportedModelError(f"{spec.name} runs on CPU only (--device cpu); on a GPU: FP8, or weight-only "
                                    f"int4 / int8 (compressed-tensors, GPTQ, AWQ)")
    pieces = [reader.read(p, dim, pt) for p, pt in zip(prefixes, parts)]

    def fused(i: int) -> Optional[torch.Tensor]:
        tensors = [p[i] for p in pieces]
        if all(t is None for t in tensors):
            return None
        if i == 2:  # a part without zero points (GPTQ's at the midpoint) beside one with: its zero points are 0
            tensors = [torch.zeros(p[1].shape) if t is None else t.float() for p, t in zip(pieces, tensors)]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    if spec.float8:
        return _float8_projection(reader, spec, prefixes, pieces, bias, layout, dtype, device, gate_size,
                                  shard if dim == 1 else None)
    q, scale, zero, mins = fused(0), fused(1), fused(2), fused(3)
    order = _input_order(reader, prefixes, dim, parts)
    if gpu:
        layer = make_gpu_int(q, scale, zero, spec.group_size, spec.bits, device, order)
    elif spec.dynamic_int8_activations:
        row_parallel = shard if dim == 1 and shard is not None and shard.size > 1 else None
        layer = make_w8a8(q, scale, gate_size if bias is None else 0, row_parallel)
    elif spec.bits == 4:
        layer = make_int4(q, scale, zero, spec.group_size, dtype, order, mins=mins)
    else:
        layer = make_int8(q, scale, zero, spec.group_size, dtype, order, q8_0=spec.format == "Q8_0")
    return LinearWeight(None, bias, out_features=layer.out_features, gate_size=gate_size, quantized=layer)


def _float8_projection(reader: _Reader, spec: QuantizationSpec, prefixes: list[str], pieces: list, bias,
                       layout: WeightLayout, dtype: torch.dtype, device: torch.device, gate_size: int,
                       shard: Optional[TensorParallelShard]) -> LinearWeight:
    """An FP8 projection (models/fp8_linear.py: dequantized at load on a CPU, torch._scaled_mm on a GPU): its
    parts fused into one layer, or, where a static scheme gives them different input scales (q, k and v each
    calibrated apart), one layer a part side by side."""
    activations = spec.float8_activations
    scales = [reader.input_scale(p) for p in prefixes] if activations == "tensor" else [None] * len(prefixes)
    if all(s is None or torch.equal(s, scales[0]) for s in scales):
        values, weight_scale = (torch.cat([p[i] for p in pieces]) for i in (0, 1))
        layer = make_fp8(values, weight_scale, dtype, layout, activations, scales[0], shard, device)
    else:
        layer = QuantizedStack(tuple(make_fp8(p[0], p[1], dtype, layout, activations, s, shard, device)
                                     for p, s in zip(pieces, scales)))
    return LinearWeight(None, bias, out_features=layer.out_features, gate_size=gate_size, quantized=layer)
