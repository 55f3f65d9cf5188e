"""A GGUF file (llama.cpp's format) as a model: what ``serve`` checks before any process starts and
what the worker reads its weights by.

``pagedserve serve x.gguf`` (or a directory holding exactly one ``.gguf`` and no config.json) is
served from a model directory made of the file's metadata (deploy/gguf_model_dir.py: config.json and
tokenizer files by transformers' GGUF loader), so the frontend, the offline LLM, ``--served-model-name``
and the model's identity read a directory as for any checkpoint. The weights stay in the file: the
directory's ``SOURCE_FILE`` names it, and the worker reads the tensors from it (worker_proc/gguf_weights.py).
That file and the GGUF itself are the agreement between the two ends, so the checks both need live
here: the architectures served, the tensor types (those with a native kernel, those dequantized at
load), and a file that is truncated or names an unknown type, refused in one line. Reads only the
header through the ``gguf`` package (numpy, no torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pagedserve.protocol.quantization import QuantizationSpec

# GGUF general.architecture -> the architecture pagedserve runs (Mistral's files say "llama": the
# model's name tells them apart, as transformers' loader does)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MISTRAL = "MistralForCausalLM"
# Tensor types with a native kernel, as the integer weight-only layers of worker_proc/models/quantized_linear.py
# hold them: (weight bits, inputs sharing a scale). Q8_0 and Q4_0 symmetric; Q5_0's blocks are Q8_0 blocks whose
# values fit in 5 bits (served as Q8_0: llama.cpp's Q5_0 x Q8_0 is the same sum); Q6_K int8 in groups of 16 (its
# int8 sub-block scale times the float16 d of 256, exact in float32); Q4_K int4 in groups of 32, each
# scale * nibble - min with a float min (d * sc and dmin * m), and Q4_1 the same with its own d and m
NATIVE_TYPES = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q5_0": (8, 32), "Q6_K": (8, 16), "Q4_K": (4, 32), "Q4_1": (4, 32)}
_WITH_MINS = ("Q4_K", "Q4_1")
# Tensor types computed in the serving dtype (F32 / F16 / BF16 as stored, the other block types dequantized at
# load by gguf.quants); the i-quants and the ternary and fp4 types are refused
FLOAT_TYPES = ("F32", "F16", "BF16")
# (Q5_K and Q5_1: 5-bit values with a float min, which no integer kernel here takes; llama-quantize's K presets put
# Q5_0 / Q8_0 where a row's inputs are no multiple of 256: Qwen2.5-0.5B's 896)
DEQUANTIZED_TYPES = ("Q5_K", "Q2_K", "Q3_K", "Q5_1")
SUPPORTED_TYPES = (*FLOAT_TYPES, *NATIVE_TYPES, *DEQUANTIZED_TYPES)
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # --load-format (vLLM's names)
_ROW_PARALLEL = {"attn_output": "o_proj", "ffn_down": "down_proj"}  # GGUF name -> the projection split on inputs
SOURCE_FILE = "gguf_source.json"  # in a model directory made of a GGUF: the file its weights are read from


def quantization_spec(type_name: str) -> QuantizationSpec:
    """The integer weight-only layer a NATIVE_TYPES tensor is served as (its signed values and one scale per
    group: Q8_0 int8, Q4_0 its nibble less 8, ...); Q5_0's is Q8_0's, so a projection fusing the two is one layer."""
    bits, block = NATIVE_TYPES[type_name]
    return QuantizationSpec("gguf", "Q8_0" if type_name == "Q5_0" else type_name, bits, block,
                            symmetric=type_name not in _WITH_MINS, dynamic_int8_activations=False)


class GGUFFileError(ValueError):
    """A GGUF model that cannot be served; the message is one line saying why."""


def find_gguf(model: str, load_format: str = "auto") -> Optional[Path]:
    """The GGUF file ``model`` names (a ``.gguf`` file, or a directory holding exactly one and, unless
    ``--load-format gguf``, no config.json); None for a model directory. GGUFFileError otherwise."""
    path = Path(model)
    if path.is_file():
        if load_format == "safetensors" or (load_format == "auto" and path.suffix != ".gguf"):
            raise GGUFFileError(f"{model} is a file, not a model directory (GGUF files end in .gguf, or "
                                f"give --load-format gguf)")
        return path.resolve()
    if not path.is_dir() or load_format == "safetensors" or (load_format == "auto" and (path / "config.json").exists()):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        what = f"{len(found)} .gguf files ({', '.join(p.name for p in found[:4])}{', ...' if len(found) > 4 else ''})"
        if not found:
            what = "no .gguf file" if (path / "config.json").exists() else "no config.json and no .gguf file"
        flag = "--load-format gguf: " if load_format == "gguf" else ""
        raise GGUFFileError(f"{flag}{model} holds {what}: give the .gguf file itself, or a directory with exactly one")
    return found[0].resolve()


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    path: Path
    gguf_architecture: str  # general.architecture
    architecture: str  # what config.json names (ARCHITECTURES)
    tensor_types: dict[str, int]  # type name -> tensors of that type
    # o_proj / down_proj -> (type, inputs a block) of their tensors' largest block of a NATIVE_TYPES type: a
    # tensor-parallel rank's slice of their inputs holds whole blocks (a k-quant's 256, not its groups' 32)
    row_parallel_blocks: dict[str, tuple[str, int]]

    @property
    def dequantized_types(self) -> list[str]:
        return [t for t in self.tensor_types if t in DEQUANTIZED_TYPES]


def _field_str(reader, key: str) -> Optional[str]:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def open_gguf(path: str | Path):
    """``gguf.GGUFReader`` over ``path`` (memory-mapped); GGUFFileError for a file it cannot parse, a
    tensor of a type GGUF does not define, or tensors that run past the file's end."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):  # the reader's own parse, each type checked first
            known = {t.value for t in gguf.GGMLQuantizationType}
            for field in fields:
                if int(field.parts[4][0]) not in known:
                    name = bytes(field.parts[1]).decode("utf-8", errors="replace")
                    raise GGUFFileError(f"{path.name}: tensor {name} has type number {int(field.parts[4][0])}, "
                                        f"which is not a GGUF tensor type; supported types: "
                                        f"{', '.join(SUPPORTED_TYPES)}")
            super()._build_tensors(start_offs, fields)

    path = Path(path)
    try:
        reader = Reader(str(path))
    except GGUFFileError:
        raise
    except Exception as exc:  # the reader's errors are numpy's reshapes and index errors of a short file
        raise GGUFFileError(f"{path.name} is not a readable GGUF file (truncated or corrupt: "
                            f"{type(exc).__name__}: {str(exc)[:120]})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise GGUFFileError(f"{path.name} is truncated: tensor {tensor.name} ends at byte "
                                f"{tensor.data_offset + tensor.n_bytes}, past the file's {size}")
    return reader


def summarize(path: str | Path) -> GGUFSummary:
    """The checks ``serve`` runs on a GGUF before any process starts: readable to its end, an
    architecture served natively, only tensor types of SUPPORTED_TYPES. GGUFFileError (one line)."""
    path = Path(path)
    reader = open_gguf(path)
    arch = _field_str(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFFileError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
                            f"{', '.join(sorted(ARCHITECTURES))} (mistral as llama)")
    architecture = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in (_field_str(reader, "general.name") or ""):
        architecture = MISTRAL  # transformers' loader's rule, so config.json says what it loads
    import gguf

    types: dict[str, int] = {}
    blocks: dict[str, tuple[str, int]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        types[kind] = types.get(kind, 0) + 1
        projection = _ROW_PARALLEL.get(tensor.name.split(".")[-2])
        if projection and kind in NATIVE_TYPES:
            block = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
            if block > blocks.get(projection, ("", 0))[1]:
                blocks[projection] = (kind, block)
    unsupported = sorted(t for t in types if t not in SUPPORTED_TYPES)
    if unsupported:
        raise GGUFFileError(f"{path.name}: tensor types {', '.join(unsupported)} are not supported; supported: "
                            f"{', '.join(SUPPORTED_TYPES)}")
    return GGUFSummary(path, arch, architecture, types, blocks)


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """A made directory's ``SOURCE_FILE``: the GGUF it stands for, as it was when the directory was made."""
    path: str
    size: int
    mtime_ns: int
    sha256: str

    @classmethod
    def of(cls, path: Path, sha256: str) -> "GGUFSource":
        stat = path.stat()
        return cls(str(path), stat.st_size, stat.st_mtime_ns, sha256)

    def write(self, model_dir: Path) -> None:
        (model_dir / SOURCE_FILE).write_text(json.dumps({"path": self.path, "size": self.size,
                                                         "mtime_ns": self.mtime_ns, "sha256": self.sha256}))

    def check_unchanged(self) -> None:
        """GGUFFileError if the file is gone or was rewritten since the directory was made of it."""
        try:
            stat = os.stat(self.path)
        except OSError:
            raise GGUFFileError(f"{self.path}: the GGUF file is gone") from None
        if (stat.st_size, stat.st_mtime_ns) != (self.size, self.mtime_ns):
            raise GGUFFileError(f"{self.path} changed since its model directory was made: serve it again")


def read_source(model_dir: str | Path) -> Optional[GGUFSource]:
    """The GGUF a model directory was made of; None for any other directory."""
    path = Path(model_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return GGUFSource(data["path"], int(data["size"]), int(data["mtime_ns"]), data["sha256"])
