"""Named tensors (or one rank's slice of them) read from a GGUF file, under the checkpoint names the
families use, for a model directory made of a GGUF (protocol/gguf_file.py's ``SOURCE_FILE``).

The file is memory-mapped by ``gguf.GGUFReader``; a tensor's GGUF name comes from the ``gguf``
package's own table (``get_tensor_name_map``, the one llama.cpp's converter writes by), and Llama's
q/k rows, which the converter permutes for llama.cpp's rotary layout, are put back as transformers'
loader puts them (``LlamaTensorProcessor``). The permutation moves whole output rows, so a quantized
tensor's rows move with their blocks' scales, before anything is decoded.

The matrices of a type with an integer kernel (protocol/gguf_file.py's ``NATIVE_TYPES``) are handed to the
integer weight-only layers as their signed values and scales (``quantized_reader``), never as floats: Q8_0,
Q4_0 and Q5_0 (int8 / int4 in blocks of 32, symmetric), Q6_K (int8 in groups of 16, the scale d * sc), Q4_K and
Q4_1 (int4 in groups of 32 with a float min each: scale * nibble - min). Each is decoded from its blocks here in
numpy, vectorised, the 6-bit scales and mins of Q4_K by the ``gguf`` package's own ``get_scale_min``, so the
weight the kernel multiplies is the one ``gguf.quants.dequantize`` gives (tests/unit/test_gguf_models.py). Every
other matrix is read in float: F32 / F16 / BF16 as stored, Q5_K and the rest dequantized here by ``gguf.quants``;
so is a quantized embedding, and a fused projection with a float part beside quantized ones. A fused projection
of different quantized types (Q4_K_M's q and k in Q4_K, v in Q6_K) is a ``QuantizedStack``, a layer per part. ``close()`` logs which types went which way (the worker log is where a user sees that a type had no
native kernel).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pagedserve.protocol.gguf_file import (DEQUANTIZED_TYPES, NATIVE_TYPES, GGUFFileError, open_gguf, quantization_spec,
                                           read_source)
from pagedserve.protocol.quantization import QuantizationSpec
from pagedserve.worker_proc.model_config import UnsupportedModelError

log = logging.getLogger("pagedserve.worker")
Part = Optional[tuple[int, int]]


class GGUFWeightSource:
    """WeightSource's interface over the GGUF file a made model directory names."""

    def __init__(self, model_dir: str | Path):
        import gguf

        model_dir = Path(model_dir)
        source = read_source(model_dir)
        try:
            source.check_unchanged()
            self._reader = open_gguf(source.path)
        except GGUFFileError as exc:
            raise UnsupportedModelError(str(exc)) from None
        self.path = Path(source.path)
        config = json.loads((model_dir / "config.json").read_text())
        field = self._reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                               int(config["num_hidden_layers"]))
        heads = int(config["num_attention_heads"])
        # llama.cpp permutes Llama's q/k rows (convert_hf_to_gguf.py LlamaModel.permute); heads per tensor
        self._permuted_heads = {"attn_q": heads, "attn_k": int(config.get("num_key_value_heads") or heads)} \
            if arch == "llama" else {}
        self._read: defaultdict[tuple[str, str], list[str]] = defaultdict(list)  # (type, native | float) -> names
        natives = sorted({t.tensor_type.name for t in self._tensors.values()} & set(NATIVE_TYPES))
        # not None: decoder layers take load_projection's path, which asks quantized_reader per tensor
        self.quantization: Optional[QuantizationSpec] = quantization_spec(natives[0]) if natives else None
        self.quantized_reader = _QuantizedReader(self) if natives else None

    # ---------------------------------------------------------------- names and raw rows

    def _gguf_name(self, name: str) -> Optional[str]:
        stem, _, suffix = name.rpartition(".")
        mapped = self._names.get_name(stem)
        return None if mapped is None else f"{mapped}.{suffix}"

    def tensor(self, name: str):
        gguf_name = self._gguf_name(name)
        if gguf_name is None or gguf_name not in self._tensors:
            raise UnsupportedModelError(f"weight {name!r} ({gguf_name or 'no GGUF name'}) is missing from "
                                        f"{self.path.name}")
        return self._tensors[gguf_name]

    def __contains__(self, name: str) -> bool:
        return self._gguf_name(name) in self._tensors

    def shape(self, name: str) -> list[int]:
        return [int(d) for d in reversed(self.tensor(name).shape.tolist())]  # GGUF lists the inputs first

    def dtype_name(self, name: str) -> str:
        return self.tensor(name).tensor_type.name

    def raw_rows(self, name: str, rows: Part) -> np.ndarray:
        """The tensor's data as stored ([out, bytes or values per row]; 1-D for a vector), its rows in
        transformers' order, only ``rows`` [start, end) of them if given."""
        tensor = self.tensor(name)
        data = tensor.data
        heads = self._permuted_heads.get(tensor.name.split(".")[-2])  # blk.N.attn_q.weight -> attn_q
        if heads is not None:
            n = data.shape[0]
            order = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(-1)
            return data[order if rows is None else order[rows[0]:rows[1]]]
        return data if rows is None else data[rows[0]:rows[1]]

    # ---------------------------------------------------------------- WeightSource's interface

    def get(self, name: str, dim: int = 0, part: Part = None) -> torch.Tensor:
        """The tensor ``name`` in float (dequantized where stored in blocks), or rows/columns
        [start, end) of it along ``dim``."""
        import gguf

        tensor = self.tensor(name)
        kind = tensor.tensor_type
        data = self.raw_rows(name, part if dim == 0 else None)
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, kind)  # float32; BF16 exactly
        self._read[(kind.name, "float")].append(tensor.name)
        out = torch.from_numpy(np.array(data))  # a copy: the map is read-only
        if dim == 1 and part is not None:
            out = out[:, part[0]:part[1]].contiguous()
        return out

    def close(self) -> None:
        """Logs which types ran natively and which were read in float, naming the types without a kernel."""
        for (kind, how), names in sorted(self._read.items()):
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
            if how == "native":
                log.info("GGUF %s: %s matrices run as integer weight-only layers, %s (%s)",
                         self.path.name, kind, _SERVED_AS[kind], shown)
            elif kind in DEQUANTIZED_TYPES:
                log.warning("GGUF %s: no native kernel for %s: dequantized at load into the serving dtype (%s)",
                            self.path.name, kind, shown)
            elif kind in NATIVE_TYPES:
                log.info("GGUF %s: %s read in float (embeddings, or a fused projection with a float part: %s)",
                         self.path.name, kind, shown)
        self._read.clear()


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 in the last axis' 2 bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(payload: np.ndarray, run: int) -> np.ndarray:
    """Bytes [..., B] whose low nibbles are the first ``run`` values of each 2 * run and high nibbles the next
    ``run`` -> the values [..., 2 B] uint8 in input order (Q4_0's runs of 16, Q4_K's of 32)."""
    v = payload.reshape(*payload.shape[:-1], -1, 1, run)
    return np.concatenate([v & 0x0F, v >> 4], axis=-2).reshape(*payload.shape[:-1], -1)


# Each decoder takes blocks [n, bytes] of its type and gives (signed values [n, inputs] int8, scales
# [n, groups] float32, mins [n, groups] float32 or None), groups of NATIVE_TYPES' size: gguf.quants' dequantize
# computes scale * value (less min) from the same numbers in float32.
def _q8_0(b: np.ndarray):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _half(b[:, None, :2]), None


def _q4_0(b: np.ndarray):
    return _nibbles(b[:, 2:], 16).astype(np.int8) - 8, _half(b[:, None, :2]), None


def _q5_0(b: np.ndarray):
    high = (np.ascontiguousarray(b[:, 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return (_nibbles(b[:, 6:], 16) | (high.astype(np.uint8) << 4)).astype(np.int8) - 16, _half(b[:, None, :2]), None


def _q4_1(b: np.ndarray):  # w = d * nibble + m
    return _nibbles(b[:, 4:], 16).astype(np.int8) - 8, _half(b[:, None, :2]), -_half(b[:, None, 2:4])


def _q4_k(b: np.ndarray):  # w = d * sc * nibble - dmin * m per 32 of 256
    import gguf

    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scale = _half(b[:, None, 0:2]) * sc.astype(np.float32)
    mins = _half(b[:, None, 2:4]) * m.astype(np.float32)
    return _nibbles(b[:, 16:], 32).astype(np.int8) - 8, scale, mins


def _q6_k(b: np.ndarray):  # w = d * sc * (q - 32) per 16 of 256: q's low 4 bits in ql, high 2 in qh
    n = b.shape[0]
    low = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).astype(np.int8) - 32
    scale = _half(b[:, None, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q.reshape(n, 256), scale, None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q5_0": _q5_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
# How the worker log names each type's layer
_SERVED_AS = {"Q8_0": "int8 in blocks of 32", "Q4_0": "int4 in blocks of 32",
              "Q5_0": "5 bits a value in blocks of 32, multiplied as Q8_0 (int8 where the inputs are no multiple of 64)",
              "Q6_K": "int8 in groups of 16 (scale d * sc)",
              "Q4_K": "int4 in groups of 32, scale * nibble - min (d * sc, dmin * m)",
              "Q4_1": "int4 in groups of 32, scale * nibble - min"}


class _QuantizedReader:
    """A GGUF's NATIVE_TYPES matrices as the integer layers take them (worker_proc/quantization.py)."""
    mixed_as_float = True  # a fused projection of float and quantized parts is read in float (the others': refuse)
    mixed_as_stack = True  # one of different quantized types is a QuantizedStack, each part its own layer

    def __init__(self, source: GGUFWeightSource):
        self.source = source

    def spec_of(self, prefix: str) -> Optional[QuantizationSpec]:
        name = prefix + ".weight"
        if name not in self.source:
            return None
        kind = self.source.tensor(name).tensor_type.name
        return quantization_spec(kind) if kind in NATIVE_TYPES else None

    def read(self, prefix: str, dim: int, part: Part) -> tuple[torch.Tensor, torch.Tensor, None,
                                                               Optional[torch.Tensor]]:
        """(signed values [rows, in] int8, float32 scales [rows, in / group], no zero point, float32 mins
        [rows, in / group] or None) of this slice."""
        import gguf

        name = prefix + ".weight"
        tensor = self.source.tensor(name)
        kind = tensor.tensor_type.name
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        raw = self.source.raw_rows(name, part if dim == 0 else None)
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, block_bytes)
        if dim == 1 and part is not None:
            start, end = part
            if start % block or end % block:
                raise UnsupportedModelError(f"{prefix}: this rank's inputs [{start}, {end}) cut a {kind} block "
                                            f"of {block}")
            blocks = blocks[:, start // block:end // block]
        q, scale, mins = _DECODERS[kind](blocks.reshape(-1, block_bytes))
        self.source._read[(kind, "native")].append(name)
        # copied by torch, not numpy: torch's allocator puts 2 MiB and more on huge pages (runtime/torch_env.py),
        # which a decode step streaming the whole matrix reads with far fewer TLB misses
        return (torch.from_numpy(q.reshape(rows, -1)).clone(), torch.from_numpy(scale.reshape(rows, -1)).clone(),
                None, None if mins is None else torch.from_numpy(mins.reshape(rows, -1)).clone())
