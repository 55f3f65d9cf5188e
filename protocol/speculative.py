"""``--speculative-config``: vLLM's JSON shape, read once, with one-line refusals.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``
is prompt lookup (vLLM's ``[ngram]``): the scheduler proposes the tokens that followed the
latest earlier occurrence of the sequence's last n tokens (scheduler_proc/speculation.py).
The other methods vLLM names are refused here, each in one line that says why, so a vLLM
command line fails at start and never runs without what it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

MAX_SPECULATIVE_TOKENS = 16  # each proposal is a query row per sequence per step: more only costs
_REFUSED = {
    "draft_model": "a draft model is not supported yet; use {\"method\": \"ngram\"}",
    "eagle": "EAGLE needs trained EAGLE heads that pagedserve cannot run; use {\"method\": \"ngram\"}",
    "eagle3": "EAGLE-3 needs trained EAGLE heads that pagedserve cannot run; use {\"method\": \"ngram\"}",
    "mtp": "MTP needs the model's multi-token-prediction layers, which no served family has; "
           "use {\"method\": \"ngram\"}",
    "medusa": "Medusa heads are not supported; use {\"method\": \"ngram\"}",
    "mlp_speculator": "MLP speculators are not supported; use {\"method\": \"ngram\"}",
    "suffix": "suffix decoding is not supported; use {\"method\": \"ngram\"}",
}
_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "backoff"}
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

    def to_json(self) -> str:
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                  "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
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
    if method in _REFUSED or (method is None and raw.get("model")):
        reason = _REFUSED.get(method, _REFUSED["draft_model"])
        raise SpeculativeConfigError(f"--speculative-config method {method or 'draft_model'!r}: {reason}")
    if method != "ngram":
        raise SpeculativeConfigError(f"--speculative-config: method must be \"ngram\", got {method!r}")
    unknown = sorted(set(raw) - _FIELDS - {"model"})
    if unknown:
        raise SpeculativeConfigError(f"--speculative-config: {', '.join(unknown)} not supported "
                                     f"(fields: {', '.join(sorted(_FIELDS))})")
    if "num_speculative_tokens" not in raw:
        raise SpeculativeConfigError("--speculative-config: num_speculative_tokens is required")
    k = _int_field(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    # vLLM's defaults: neither given, 5 and 5; one given, the other equals it
    high = _int_field(raw, "prompt_lookup_max", raw.get("prompt_lookup_min", 5), 1, 64)
    low = _int_field(raw, "prompt_lookup_min", raw.get("prompt_lookup_max", 5), 1, 64)
    if low > high:
        raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min ({low}) exceeds "
                                     f"prompt_lookup_max ({high})")
    backoff = raw.get("backoff", "expected_gain")
    if backoff not in BACKOFFS:
        raise SpeculativeConfigError(f"--speculative-config: backoff must be one of {', '.join(BACKOFFS)}, "
                                     f"got {backoff!r}")
    return SpeculativeConfig("ngram", k, high, low, backoff)
