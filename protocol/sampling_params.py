"""What a request asks for: the value ranges every frontend-sent number is checked against,
and the sampling parameters (with an optional grammar) an AddRequest carries.

Split from messages.py, which re-exports every name here: these are plain structs, not
tagged messages, and the range constants are read by the validators and the frontends.
"""

from __future__ import annotations

from typing import Annotated, Optional

import msgspec

# ----------------------------------------------------------------------- value ranges
# Every number a frontend sends has a stated range, enforced whenever a frame is decoded,
# so an out-of-range value is one rejected frame and never an exception deep in a process.
# Checks that need context (the vocabulary, the context length) are in protocol/validate.py.
# Why these bounds: docs/DECISIONS.md, "Request ranges".

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1  # above any vocabulary; the exact bound is the model's vocab size
MAX_COUNT = (1 << 31) - 1  # token counts: far above any context length
MAX_N = 4096  # parallel samples of one request; a scheduler also caps n at its max_num_seqs
MAX_TEMPERATURE = 1e6  # finite; at this temperature every distribution is already uniform
MAX_REQUEST_ID_CHARS = 256
MAX_TOP_LOGPROBS = 1024  # alternatives per token on the wire; a deployment's --max-logprobs is lower
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +-100 already bans or forces a token

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Seed = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One grammar that constrains a request's output; exactly one field is set.

    vLLM's ``StructuredOutputsParams`` names. ``json`` is a JSON Schema serialized as text,
    so the wire type stays closed; the scheduler compiles it (docs/DECISIONS.md,
    "Structured output").
    """

    json: Optional[str] = None  # JSON Schema text
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # EBNF (GBNF dialect, as xgrammar reads it)
    # The grammar starts only once the output has generated these tokens, in a row (a reasoning
    # parser's end tag: the thinking before it is free text, as in vLLM); empty: from the first token.
    start_after: list[TokenId] = []

    def kinds_set(self) -> list[str]:
        """The names of the fields that are set; a valid one has exactly one."""
        return [name for name in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(self, name) not in (None, False)]


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)] = 1.0  # NaN fails both
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=MAX_COUNT)] = 0  # 0 or -1: disabled
    seed: Optional[Seed] = None  # None: the scheduler assigns one, so traces replay exactly
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0
    logprobs: bool = False  # return the sampled token's logprob
    # Sampling controls with vLLM's semantics (docs/DECISIONS.md, "Sampling order").
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0  # output tokens
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0  # output tokens
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] = 1.0  # prompt and output
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    logit_bias: dict[TokenId, Annotated[float, msgspec.Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] = {}
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # alternatives, with logprobs
    # vLLM's prompt_logprobs: each prompt token's logprob (and this many alternatives) under the
    # model's distribution at the position before it. None: not computed. A request with it skips
    # the prefix cache, whose hits compute nothing (docs/DECISIONS.md, "Prompt logprobs").
    prompt_logprobs: Optional[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    structured_outputs: Optional[StructuredOutputs] = None  # output constrained by a grammar
