"""``--speculative-config``: vLLM's JSON shape, read once, with one-line refusals.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``
is prompt lookup (vLLM's ``[ngram]``): the scheduler proposes the tokens that followed the
latest earlier occurrence of the sequence's last n tokens (scheduler_proc/speculation.py).
``{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}`` (or vLLM's
``{"model": DIR, ...}`` without a method) proposes with a smaller model of the same vocabulary,
run by the worker beside the target (worker_proc/draft_model.py); ``check_draft_model`` refuses,
before anything starts, what it cannot run: tensor parallelism, a vocabulary of another size.
The other methods vLLM names are refused here, each in one line that says why, so a vLLM
command line fails at start and never runs without what it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

MAX_SPECULATIVE_TOKENS = 16  # each proposal is a query row per sequence per step: more only costs
_REFUSED = {
    "eagle": "EAGLE needs trained EAGLE heads that pagedserve cannot run; use {\"method\": \"ngram\"}",
    "eagle3": "EAGLE-3 needs trained EAGLE heads that pagedserve cannot run; use {\"method\": \"ngram\"}",
    "mtp": "MTP needs the model's multi-token-prediction layers, which no served family has; "
           "use {\"method\": \"ngram\"}",
    "medusa": "Medusa heads are not supported; use {\"method\": \"ngram\"}",
    "mlp_speculator": "MLP speculators are not supported; use {\"method\": \"ngram\"}",
    "suffix": "suffix decoding is not supported; use {\"method\": \"ngram\"}",
}
_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "backoff"}
_DRAFT_FIELDS = {"method", "model", "num_speculative_tokens", "backoff"}
METHODS = ("ngram", "draft_model")
# "expected_gain": a sequence proposes only what its acceptance makes worth the measured cost of a
# row (scheduler_proc/spec_cost.py); "acceptance": by its acceptance alone, whatever a row costs
# (tests that need proposals on a model where they never pay: golden_speculative).
BACKOFFS = ("expected_gain", "acceptance")


class SpeculativeConfigError(ValueError):
    """A ``--speculative-config`` that cannot work; the message names the field and why."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: proposals per sequence per step, at most
    prompt_lookup_max: int  # the longest suffix matched
    prompt_lookup_min: int  # the shortest suffix matched
    backoff: str = "expected_gain"  # pagedserve's own field (BACKOFFS)
    model: Optional[str] = None  # draft_model: the draft's directory

    def to_json(self) -> str:
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "draft_model":
            fields["model"] = self.model
        else:
            fields.update(prompt_lookup_max=self.prompt_lookup_max, prompt_lookup_min=self.prompt_lookup_min)
        if self.backoff != "expected_gain":
            fields["backoff"] = self.backoff
        return json.dumps(fields, sort_keys=True)


def _int_field(raw: dict, name: str, default, low: int, high: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpeculativeConfigError(f"--speculative-config: {name} must be an integer in [{low}, {high}], "
                                     f"got {value!r}")
    return value


def parse_speculative_config(value: Union[str, dict, None]) -> "SpeculativeConfig | None":
    """``value`` (JSON text or a dict, as ``LLM(speculative_config={...})``) checked; None: off."""
    if value is None:
        return None
    raw: Any = value
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError(f"--speculative-config must be a JSON object, got {type(raw).__name__}")
    method = raw.get("method")
    if method is None and raw.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
        method = "ngram"
    elif method is None and raw.get("model"):  # vLLM: a model and no method is a draft model
        method = "draft_model"
    if method in _REFUSED:
        raise SpeculativeConfigError(f"--speculative-config method {method!r}: {_REFUSED[method]}")
    if method not in METHODS:
        raise SpeculativeConfigError(f"--speculative-config: method must be one of {', '.join(METHODS)}, "
                                     f"got {method!r}")
    fields = _DRAFT_FIELDS if method == "draft_model" else _FIELDS | {"model"}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise SpeculativeConfigError(f"--speculative-config: {', '.join(unknown)} not supported with method "
                                     f"{method!r} (fields: {', '.join(sorted(fields))})")
    if "num_speculative_tokens" not in raw:
        raise SpeculativeConfigError("--speculative-config: num_speculative_tokens is required")
    k = _int_field(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    backoff = raw.get("backoff", "expected_gain")
    if backoff not in BACKOFFS:
        raise SpeculativeConfigError(f"--speculative-config: backoff must be one of {', '.join(BACKOFFS)}, "
                                     f"got {backoff!r}")
    if method == "draft_model":
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise SpeculativeConfigError("--speculative-config: model (the draft model's directory) is required "
                                         "with method \"draft_model\"")
        return SpeculativeConfig("draft_model", k, 0, 0, backoff, model)
    # vLLM's defaults: neither given, 5 and 5; one given, the other equals it
    high = _int_field(raw, "prompt_lookup_max", raw.get("prompt_lookup_min", 5), 1, 64)
    low = _int_field(raw, "prompt_lookup_min", raw.get("prompt_lookup_max", 5), 1, 64)
    if low > high:
        raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min ({low}) exceeds "
                                     f"prompt_lookup_max ({high})")
    return SpeculativeConfig("ngram", k, high, low, backoff)


def _vocab_size(model_dir: Path) -> Optional[int]:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))


def check_draft_model(config: Optional[SpeculativeConfig], target_dir: str, tensor_parallel_size: int) -> None:
    """What a draft model needs beyond its JSON, checked where both model directories are seen
    (ServeConfig, the worker): one line naming the field when it cannot run."""
    if config is None or config.method != "draft_model":
        return
    if tensor_parallel_size > 1:
        raise SpeculativeConfigError("--speculative-config method \"draft_model\" runs on one device: "
                                     f"--tensor-parallel-size must be 1, got {tensor_parallel_size}")
    draft = Path(config.model)
    if not (draft / "config.json").is_file():
        raise SpeculativeConfigError(f"--speculative-config: model {config.model!r} is not a model directory "
                                     f"(no config.json)")
    ours, theirs = _vocab_size(draft), _vocab_size(Path(target_dir))
    if ours != theirs:
        raise SpeculativeConfigError(f"--speculative-config: model {config.model!r} has a vocabulary of {ours} "
                                     f"tokens and the target {theirs}: a draft must share the target's tokenizer")
