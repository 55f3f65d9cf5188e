"""The model directory a GGUF file is served from, made once and kept in a private cache.

transformers' GGUF loader reads the file's metadata (``AutoConfig`` / ``AutoTokenizer`` with
``gguf_file=``), and what it makes is saved as any checkpoint's: config.json (its ``architectures``
set, the dtype the file's matrices suggest, and ``pagedserve_gguf``: the file's name and content hash,
so the model's identity and a trace's fingerprint change with the weights) and the tokenizer's files,
or those of ``--tokenizer DIR`` instead. No weight is copied: ``protocol/gguf_file.py``'s
``SOURCE_FILE`` names the GGUF, and each worker reads its tensors from there. Every process then
reads one directory, as for a safetensors checkpoint, and the GGUF stays the one source of weights.

The cache (``$PAGEDSERVE_CACHE``, else ``~/.cache/pagedserve``, then ``gguf/``) is keyed by the file's
path, size and modification time and the tokenizer directory's, so a rewritten file is made again;
a directory is written under a temporary name and renamed into place, so a half-made one is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from pagedserve.protocol.gguf_file import NATIVE_TYPES, GGUFSource, GGUFSummary, summarize


def cache_root() -> Path:
    base = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    return Path(base) / "gguf"


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


_DIR_VERSION = 2  # a directory made by an older pagedserve lacks config.json's later fields: made anew


def _key(gguf: Path, tokenizer: Optional[Path]) -> str:
    parts = [_DIR_VERSION, str(gguf), gguf.stat().st_size, gguf.stat().st_mtime_ns]
    if tokenizer is not None:
        parts += [str(tokenizer)] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                     for f in sorted(tokenizer.iterdir()) if f.is_file()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _serving_dtype(summary: GGUFSummary) -> str:
    """What ``--dtype auto`` starts from: float32 for a float32 file, else the matrices' half type
    (quantized blocks are computed in bfloat16; runtime/options.resolve_dtype keeps it on any CPU where every
    matrix is on an integer kernel: ``integer_matrices``)."""
    types = set(summary.tensor_types) - {"F32"}
    if not types:
        return "float32"
    return "float16" if types == {"F16"} else "bfloat16"


def _integer_matrices(summary: GGUFSummary) -> bool:
    """Whether every tensor is a block type the native integer kernels multiply (or float32: the norms)."""
    types = set(summary.tensor_types) - {"F32"}
    return bool(types) and types <= set(NATIVE_TYPES)


def gguf_model_dir(gguf: Path, tokenizer: Optional[str] = None) -> Path:
    """The model directory of ``gguf`` (checked: protocol/gguf_file.py's ``summarize``), made if the
    cache has none; raises GGUFFileError or ValueError (one line) for a file transformers cannot read."""
    summary = summarize(gguf)
    tokenizer_dir = Path(tokenizer).resolve() if tokenizer else None
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise ValueError(f"--tokenizer {tokenizer}: not a directory")
    target = cache_root() / _key(gguf, tokenizer_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix=".making-", dir=target.parent))
    try:
        _make(summary, tokenizer_dir, work)
        try:
            os.rename(work, target)
        except OSError:  # another process made it meanwhile: theirs is the same
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _check_shapes(summary: GGUFSummary, config) -> None:
    """The query rows the config implies are the file's: transformers' loader reads no head size for
    some architectures (Qwen3 takes its config class's 128), and a file that differs would fail in
    every worker."""
    from pagedserve.protocol.gguf_file import open_gguf

    q = next((t for t in open_gguf(summary.path).tensors if t.name == "blk.0.attn_q.weight"), None)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if q is not None and int(q.shape[1]) != heads * head_dim:
        raise ValueError(f"{summary.path.name}: blk.0.attn_q.weight has {int(q.shape[1])} rows, but the metadata "
                         f"as transformers reads it gives {heads} heads of {head_dim}")


def _make(summary: GGUFSummary, tokenizer_dir: Optional[Path], out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    gguf = summary.path
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = (AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir is not None
                     else AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    except Exception as exc:  # noqa: BLE001 (the loader's errors on metadata it does not expect are of any type)
        first = (str(exc).splitlines() or [""])[0][:200]
        raise ValueError(f"{gguf.name}: transformers cannot read its metadata: {type(exc).__name__}: {first}") \
            from None
    _check_shapes(summary, config)
    config.architectures = [summary.architecture]
    config.dtype = _serving_dtype(summary)
    config.pagedserve_gguf = {"file": gguf.name, "sha256": _content_hash(gguf),
                              "integer_matrices": _integer_matrices(summary)}
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GGUFSource.of(gguf, config.pagedserve_gguf["sha256"]).write(out)
