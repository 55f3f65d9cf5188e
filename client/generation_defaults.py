"""``--generation-config``: the model's default sampling parameters, as vLLM reads them.

``auto`` reads the model directory's ``generation_config.json``, a directory reads that
directory's, ``vllm`` reads none. Of the file, vLLM takes ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``), and
only where they differ from transformers' own defaults (it reads the file's diff against
``GenerationConfig()``); ``do_sample`` is not read. A request's own value always wins.

Shared by the HTTP frontend and the offline LLM (a pure function of files, no process).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from pagedserve.protocol.messages import SamplingParams
from pagedserve.protocol.validate import InvalidField, check_message

# transformers' GenerationConfig() values: a file that repeats them sets no default
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
_READ = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
         "repetition_penalty": float, "max_new_tokens": int}


class GenerationConfigError(ValueError):
    """--generation-config names nothing readable; the message says what to give."""


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        """The defaults that are set, by SamplingParams field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def _source_dir(option: str, model_dir: str) -> Optional[Path]:
    if option == "vllm":
        return None
    if option == "auto":
        return Path(model_dir)
    path = Path(option)
    if not path.is_dir():
        raise GenerationConfigError(f"--generation-config {option!r}: expected auto, vllm or a directory "
                                    f"holding generation_config.json")
    return path


def check_generation_config_option(option: str, model_dir: str) -> None:
    load_generation_defaults(option, model_dir)


def load_generation_defaults(option: str, model_dir: str) -> GenerationDefaults:
    source = _source_dir(option, model_dir)
    if source is None or not (source / "generation_config.json").is_file():
        return GenerationDefaults()  # vLLM too: a model without the file has no defaults
    try:
        raw = json.loads((source / "generation_config.json").read_text())
    except ValueError as exc:
        raise GenerationConfigError(f"{source / 'generation_config.json'} is not JSON: {exc}") from None
    values: dict[str, Any] = {}
    for name, kind in _READ.items():
        value = raw.get(name)
        if value is None or value == _TRANSFORMERS_DEFAULTS.get(name):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GenerationConfigError(f"{source / 'generation_config.json'}: {name} must be a number, "
                                        f"got {value!r}")
        values["max_tokens" if name == "max_new_tokens" else name] = kind(value)
    try:  # out of the protocol's ranges: refused at start, not in every request's 400
        check_message(SamplingParams(**values))
    except InvalidField as exc:
        raise GenerationConfigError(f"{source / 'generation_config.json'}: {exc}") from None
    return GenerationDefaults(**values)
