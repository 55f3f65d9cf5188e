"""What every client of an embedding deployment does: the pooler settings, ``dimensions``, and
the last steps of an embedding (truncate, then L2-normalise), for the frontend and ``LLM.embed``.

The scheduler sends the pooled vector as it is (protocol/pooling.py); normalising here lets a
request's ``dimensions`` truncate first and normalise the shorter vector, as Matryoshka
models are meant to be read (Qwen3-Embedding, vLLM). ``dimensions`` is honoured only where
the model's config.json declares Matryoshka training (vLLM's ``is_matryoshka`` /
``matryoshka_dimensions``); elsewhere it is refused, since a truncated vector of another
model is not an embedding of its own.

A sentence-transformers model dir (``modules.json``) carries its pooler: the Pooling module's
``pooling_mode_*`` and whether a Normalize module follows. Those are the defaults, as vLLM
reads them, below ``--pooling-type`` / ``--pooler-config``; a mode this server cannot pool
(cls, max, ...) is refused rather than served as another, which would be a different embedding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pagedserve.client.model_files import read_json
from pagedserve.protocol.pooling import POOLING_TYPES

DEFAULT_POOLING = "last"  # vLLM's for decoder models served as embedders (Qwen3-Embedding's)
_POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True, slots=True)
class PoolerSettings:
    pooling_type: str = DEFAULT_POOLING  # "last" | "mean"
    normalize: bool = True  # L2-normalise every embedding
    # the fields the flags set; the model's sentence-transformers files fill only the others
    given: frozenset[str] = field(default=frozenset(), compare=False)

    def under_model_defaults(self, model_dir: str | Path) -> "PoolerSettings":
        defaults = sentence_transformers_pooler(Path(model_dir), "pooling_type" not in self.given)
        return replace(self, **{k: v for k, v in defaults.items() if k not in self.given})


_ST_POOLING, _ST_NORMALIZE = "sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize"
_ST_MODES = {"mean_tokens": "mean", "lasttoken": "last"}


def sentence_transformers_pooler(model_dir: Path, with_pooling_type: bool = True) -> dict[str, Any]:
    """``pooling_type`` and ``normalize`` from modules.json, where the model has one; ValueError for
    a pooling mode other than mean or last token, unless the pooling type is not wanted (a flag set it)."""
    modules = read_json(model_dir / "modules.json")
    if not isinstance(modules, list) or not modules:
        return {}
    types = {m.get("type"): m.get("path", "") for m in modules if isinstance(m, dict)}
    found: dict[str, Any] = {"normalize": _ST_NORMALIZE in types}
    if with_pooling_type and _ST_POOLING in types:
        config = read_json(model_dir / types[_ST_POOLING] / "config.json")
        modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        if len(modes) != 1 or modes[0] not in _ST_MODES:
            raise ValueError(f"{model_dir / types[_ST_POOLING]}: pooling mode {'+'.join(modes) or 'none'} is not "
                             f"supported, only mean_tokens or lasttoken; pass --pooling-type to override")
        found["pooling_type"] = _ST_MODES[modes[0]]
    return found


def pooler_settings(pooling_type: Optional[str], pooler_config: Optional[str]) -> PoolerSettings:
    """The deployment's pooler from ``--pooling-type`` and vLLM's ``--pooler-config`` JSON
    (``{"pooling_type": "MEAN", "normalize": true}``); ValueError names what is wrong."""
    config: dict[str, Any] = {}
    if pooler_config is not None:
        try:
            config = json.loads(pooler_config)
        except ValueError:
            raise ValueError(f"--pooler-config is not JSON: {pooler_config!r}") from None
        if not isinstance(config, dict):
            raise ValueError("--pooler-config must be a JSON object such as {\"pooling_type\": \"MEAN\"}")
        unknown = sorted(set(config) - set(_POOLER_KEYS))
        if unknown:
            raise ValueError(f"--pooler-config: {', '.join(unknown)} not supported; only {', '.join(_POOLER_KEYS)}")
    from_config = config.get("pooling_type")
    if from_config is not None:
        if not isinstance(from_config, str) or from_config.lower() not in POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type must be one of LAST, MEAN, got {from_config!r}")
        from_config = from_config.lower()
        if pooling_type is not None and pooling_type != from_config:
            raise ValueError(f"--pooling-type {pooling_type} and --pooler-config's {from_config} disagree")
    normalize = config.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"--pooler-config normalize must be true or false, got {normalize!r}")
    given = frozenset(k for k, v in (("pooling_type", pooling_type or from_config), ("normalize", "normalize" in config))
                      if v)
    return PoolerSettings(pooling_type or from_config or DEFAULT_POOLING, normalize, given)


@dataclass(frozen=True, slots=True)
class Matryoshka:
    """Which output sizes the model was trained to be read at (config.json)."""

    supported: bool = False
    sizes: Optional[tuple[int, ...]] = None  # None: any size up to the hidden size

    @classmethod
    def of(cls, model_config: dict) -> "Matryoshka":
        sizes = model_config.get("matryoshka_dimensions")
        if isinstance(sizes, list) and sizes and all(isinstance(s, int) for s in sizes):
            return cls(True, tuple(sizes))
        return cls(bool(model_config.get("is_matryoshka")))

    def refusal(self, dimensions: int, hidden_size: int) -> Optional[str]:
        """Why ``dimensions`` cannot be served for this model, or None."""
        if not self.supported:
            return ("dimensions is not supported: the model does not declare Matryoshka training "
                    "(config.json's is_matryoshka or matryoshka_dimensions), so a truncated vector is no embedding")
        if self.sizes is not None and dimensions not in self.sizes:
            return f"dimensions must be one of {list(self.sizes)} for this model, got {dimensions}"
        if not 1 <= dimensions <= hidden_size:
            return f"dimensions must be between 1 and the model's {hidden_size}, got {dimensions}"
        return None


def finish_embedding(raw: bytes, dimensions: Optional[int] = None, normalize: bool = True) -> np.ndarray:
    """The scheduler's pooled vector, truncated to ``dimensions`` and then L2-normalised (float32)."""
    vector = np.frombuffer(raw, "<f4")
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        wide = vector.astype(np.float64)
        norm = float(np.sqrt(wide @ wide))
        vector = wide / max(norm, 1e-12)  # torch.nn.functional.normalize's eps
    return vector.astype(np.float32)
