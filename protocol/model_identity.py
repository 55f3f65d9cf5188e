"""What names a model across processes and recordings: its ``config.json`` as a value, without
the ``transformers_version`` that wrote it. A new transformers release rewrites that field of
the same model (5.25 did), and with whole-file hashes every golden trace's model stopped
matching its recording and every worker's model id changed."""

from __future__ import annotations

import json
from pathlib import Path


def config_identity(path: str | Path) -> bytes:
    """The bytes to hash for ``path`` (a config.json): sorted keys, the writer's version left out."""
    raw = Path(path).read_bytes()
    try:
        config = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(config, dict):
        config.pop("transformers_version", None)
    return json.dumps(config, sort_keys=True).encode()
