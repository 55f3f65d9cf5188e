"""What a client reads from a model directory beside its tokenizer: the EOS ids and the vocabulary size.

One reader for the frontend and the offline ``LLM``, so the two stop on the same tokens and
refuse the same ids. ``"eos_token_id": null`` in generation_config.json means no EOS there
(config.json's is not consulted), and an unreadable file is logged and read as empty, since a
model transformers itself can load should not fail to serve over a malformed side file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def eos_token_ids(model_dir: Path, tokenizer) -> list[int]:
    """generation_config.json's EOS ids (else config.json's), plus the tokenizer's own."""
    config = read_json(model_dir / "config.json")
    generation_config = read_json(model_dir / "generation_config.json")
    eos = _as_id_list(generation_config.get("eos_token_id", config.get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    return sorted(set(eos))


def vocab_size(model_dir: Path, tokenizer) -> int:
    """The embedding's rows: the model may have more than the tokenizer has tokens, and an id at
    or above them is an index no worker can look up."""
    return int(read_json(model_dir / "config.json").get("vocab_size") or 0) or len(tokenizer)
