"""Named tensors (or one rank's slice of them) read from a GGUF file, under the checkpoint names the
families use, for a model directory made of a GGUF (protocol/gguf_file.py's ``SOURCE_FILE``).

The file is memory-mapped by ``gguf.GGUFReader``; a tensor's GGUF name comes from the ``gguf``
package's own table (``get_tensor_name_map``, the one llama.cpp's converter writes by), and Llama's
q/k rows, which the converter permutes for llama.cpp's rotary layout, are put back as transformers'
loader puts them (``LlamaTensorProcessor``). The permutation moves whole output rows, so a quantized
tensor's rows move with their blocks' scales, before anything is decoded.

Q8_0 and Q4_0 matrices (blocks of 32 inputs, one float16 scale each, symmetric) are handed to the
integer weight-only layers as their signed values and scales (``quantized_reader``: int8 in groups of
32, int4 in groups of 32), never as floats. Every other matrix is read in float: F32 / F16 / BF16 as
stored, the k-quants (Q4_K, Q5_K, Q6_K) dequantized here by ``gguf.quants``; so is a quantized
embedding, and a fused projection whose parts differ in type. ``close()`` logs which types went which
way (the worker log is where a user sees that a type had no native kernel).
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
                log.info("GGUF %s: %s matrices run as integer weight-only layers, groups of 32 (%s)",
                         self.path.name, kind, shown)
            elif kind in DEQUANTIZED_TYPES:
                log.warning("GGUF %s: no native kernel for %s: dequantized at load into the serving dtype (%s)",
                            self.path.name, kind, shown)
            elif kind in NATIVE_TYPES:
                log.info("GGUF %s: %s read in float (embeddings, or a fused projection of mixed types: %s)",
                         self.path.name, kind, shown)
        self._read.clear()


class _QuantizedReader:
    """A GGUF's Q8_0 / Q4_0 matrices as the integer layers take them (worker_proc/quantization.py)."""
    mixed_as_float = True  # a fused projection of different types is read in float (the others' rule: refuse)

    def __init__(self, source: GGUFWeightSource):
        self.source = source

    def spec_of(self, prefix: str) -> Optional[QuantizationSpec]:
        name = prefix + ".weight"
        if name not in self.source:
            return None
        kind = self.source.tensor(name).tensor_type.name
        return quantization_spec(kind) if kind in NATIVE_TYPES else None

    def read(self, prefix: str, dim: int, part: Part) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(signed values [rows, in] int8, float32 scales [rows, in / 32], no zero point) of this slice."""
        name = prefix + ".weight"
        kind = self.source.tensor(name).tensor_type.name
        bits, block = NATIVE_TYPES[kind]
        raw = self.source.raw_rows(name, part if dim == 0 else None)
        rows, block_bytes = raw.shape[0], 2 + block * bits // 8
        blocks = raw.reshape(rows, -1, block_bytes)
        if dim == 1 and part is not None:
            start, end = part
            if start % block or end % block:
                raise UnsupportedModelError(f"{prefix}: this rank's inputs [{start}, {end}) cut a {kind} block "
                                            f"of {block}")
            blocks = blocks[:, start // block:end // block]
        scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
        payload = np.ascontiguousarray(blocks[..., 2:])
        if bits == 8:
            q = payload.view(np.int8)
        else:  # Q4_0: a block's first 16 values in the low nibbles, the next 16 in the high ones
            q = (np.concatenate([payload & 0x0F, payload >> 4], axis=-1).astype(np.int8) - 8)
        self.source._read[(kind, "native")].append(name)
        # copied by torch, not numpy: torch's allocator puts 2 MiB and more on huge pages (runtime/torch_env.py),
        # which a decode step streaming the whole matrix reads with far fewer TLB misses
        return torch.from_numpy(q.reshape(rows, -1)).clone(), torch.from_numpy(scale).clone(), None
