"""What every client of an embedding deployment does: the pooler settings, ``dimensions``, and
the last steps of an embedding (truncate, then L2-normalise), for the frontend and ``LLM.embed``.

The scheduler sends the pooled vector as it is (protocol/pooling.py); normalising here lets a
request's ``dimensions`` truncate first and normalise the shorter vector, as Matryoshka
models are meant to be read (Qwen3-Embedding, vLLM). ``dimensions`` is honoured only where
the model's config.json declares Matryoshka training (vLLM's ``is_matryoshka`` /
``matryoshka_dimensions``); elsewhere it is refused, since a truncated vector of another
model is not an embedding of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pagedserve.protocol.pooling import POOLING_TYPES

DEFAULT_POOLING = "last"  # vLLM's for decoder models served as embedders (Qwen3-Embedding's)
_POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True, slots=True)
class PoolerSettings:
    pooling_type: str = DEFAULT_POOLING  # "last" | "mean"
    normalize: bool = True  # L2-normalise every embedding


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
    return PoolerSettings(pooling_type or from_config or DEFAULT_POOLING, normalize)


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
