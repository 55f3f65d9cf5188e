"""Reads named tensors (or one rank's slice of them) from an HF model directory's safetensors.

A sharded checkpoint lists which file holds each tensor in
``model.safetensors.index.json``; without an index every ``*.safetensors`` file is
scanned. Slices are read with ``get_slice`` so a tensor-parallel rank never materialises
the full weight. ``quantization``: config.json's quantization scheme (worker_proc/quantization.py
loads the projections it covers). A model directory made of a GGUF file reads the file instead
(``open_weights``; worker_proc/gguf_weights.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from pagedserve.worker_proc.model_config import UnsupportedModelError


def open_weights(model_dir: str | Path):
    """The weights of ``model_dir``: its safetensors, or the GGUF file it was made of."""
    from pagedserve.protocol.gguf_file import read_source

    if read_source(model_dir) is not None:
        from pagedserve.worker_proc.gguf_weights import GGUFWeightSource

        return GGUFWeightSource(model_dir)
    return WeightSource(model_dir)


class WeightSource:
    def __init__(self, model_dir: str | Path):
        from pagedserve.worker_proc.quantization import checkpoint_quantization

        model_dir = Path(model_dir)
        self.quantization = checkpoint_quantization(model_dir)
        index_path = model_dir / "model.safetensors.index.json"
        self._file_of: dict[str, Path] = {}
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            self._file_of = {name: model_dir / file for name, file in weight_map.items()}
        else:
            for path in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self._file_of.update({name: path for name in f.keys()})
        if not self._file_of:
            raise UnsupportedModelError(f"no *.safetensors weights found in {model_dir}")
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        path = self._file_of[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """safetensors' name of the tensor's dtype ("I8", "BF16", ...), without reading it."""
        return self._handle(name).get_slice(name).get_dtype()

    def get(self, name: str, dim: int = 0, part: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """The tensor ``name``, or rows/columns [start, end) of it along ``dim``."""
        handle = self._handle(name)
        if part is None:
            return handle.get_tensor(name)
        start, end = part
        tensor_slice = handle.get_slice(name)
        if dim == 0:
            return tensor_slice[start:end]
        return tensor_slice[:, start:end]

    def close(self) -> None:
        self._open.clear()
