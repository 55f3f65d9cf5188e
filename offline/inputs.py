"""What ``LLM.generate`` accepts, checked before anything is sent: the sampling parameters and
the prompts (vLLM's forms). A bad value raises ``ValueError`` naming the field at once; a value
the engine refused after sending would leave the caller waiting for an answer.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Optional, Union

import msgspec

from pagedserve.protocol import messages as m
from pagedserve.offline.structured import as_structured_outputs
from pagedserve.protocol.validate import InvalidField, check_message, unencodable_string
from pagedserve.protocol.priority import PRIORITY_MAX, PRIORITY_MIN

Prompt = Union[str, list[int], dict]


@dataclass
class SamplingParams:
    """The protocol's SamplingParams (same names, same ranges) plus ``stop`` strings, which the
    caller's side applies, exactly as the HTTP frontend does (client/sample_text.py)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: Optional[int] = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's: per sampled token a dict token id -> Logprob holding it and the k most likely
    # tokens; a bool counts as the int it is (True: 1), as in vLLM.
    logprobs: Union[bool, int, None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Optional[dict[int, float]] = None  # token id -> bias in [-100, 100]
    best_of: Optional[int] = None  # only None or n: no extra candidates are sampled
    # vLLM's: RequestOutput.prompt_logprobs, per prompt token a dict token id -> Logprob of the
    # prompt token and the k most likely (None for the first token). Skips the prefix cache.
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True  # False: special tokens are part of the text
    # A grammar the output must follow: StructuredOutputsParams, or a dict of its keys.
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        self._normalise()

    def _normalise(self) -> None:
        """The checks and canonical forms, run again by to_protocol(): vLLM's idiom sets fields
        after construction (``sp = llm.get_default_sampling_params(); sp.best_of = 4``), and a
        value set so must behave as if it had been passed to the constructor."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidField("stop", f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        _check_encodable("stop", self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidField("skip_special_tokens", f"must be True or False, got {self.skip_special_tokens!r}")
        if self.logprobs is not None and not isinstance(self.logprobs, (bool, int)):
            raise InvalidField("logprobs", f"logprobs must be None, True or a number of alternatives, "
                                           f"got {self.logprobs!r}")
        if isinstance(self.logprobs, bool):
            self.logprobs = int(self.logprobs)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidField("logit_bias", f"logit_bias must be a dict token id -> bias, got {self.logit_bias!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)):
            raise InvalidField("prompt_logprobs", f"prompt_logprobs must be None or a number of alternatives "
                                                  f"(>= 0), got {self.prompt_logprobs!r}")
        _check_encodable("structured_outputs", _fields_of(self.structured_outputs))
        self.structured_outputs = as_structured_outputs(self.structured_outputs)
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidField("best_of", f"only best_of equal to n ({self.n}) is supported, got {self.best_of}")
        try:
            check_message(self._wire())
        except InvalidField as exc:
            if exc.field != "top_logprobs":
                raise
            raise InvalidField("logprobs", f"{exc.reason} (alternatives per token)") from None
        if self.min_tokens > self.max_tokens:
            raise InvalidField("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens "
                                             f"({self.max_tokens})")

    def to_protocol(self) -> m.SamplingParams:
        """The wire form, after the constructor's checks on the fields as they are now."""
        self._normalise()
        return self._wire()

    def _wire(self) -> m.SamplingParams:
        wire = set(m.SamplingParams.__struct_fields__)
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name in wire}
        if isinstance(values["stop_token_ids"], (list, tuple)):
            values["stop_token_ids"] = list(values["stop_token_ids"])
        values["logprobs"] = self.logprobs is not None
        values["top_logprobs"] = self.logprobs or 0
        values["logit_bias"] = dict(self.logit_bias or {})
        return m.SamplingParams(**values)


def check_engine_limits(sp: SamplingParams, max_logprobs: int, max_num_seqs: int) -> None:
    """What the engine's settings allow a request (``LLM(max_logprobs=..., max_num_seqs=...)``),
    refused before sending: the scheduler would end the request with an error output instead,
    and vLLM raises here too (its messages)."""
    for field, kind, asked in (("logprobs", "sample", sp.logprobs), ("prompt_logprobs", "prompt", sp.prompt_logprobs)):
        if asked is not None and asked > max_logprobs:
            raise InvalidField(field, f"Requested {kind} logprobs of {asked}, which is greater than max of "
                                      f"{max_logprobs} (LLM(max_logprobs=...))")
    if sp.n > max_num_seqs:
        raise InvalidField("n", f"n={sp.n} parallel samples exceed max_num_seqs={max_num_seqs}, the most "
                                f"sequences one step can run")


def _fields_of(value: Any) -> Any:
    """A dataclass or msgspec struct as a dict, for the string check; anything else as it is."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.asdict(value)
    return value


def _check_encodable(field: str, value: Any) -> None:
    """The HTTP frontend's rule (protocol/validate.py): a lone surrogate is no text any tokenizer,
    grammar or frame can take, so it is refused here, naming where it is."""
    found = unencodable_string(value, field)
    if found:
        raise InvalidField(found[0], found[1])


def prompt_token_ids(prompt: Any, encode) -> list[int]:
    """A prompt in any of vLLM's forms (str, token ids, {"prompt": str}, {"prompt_token_ids": ids})
    as token ids; ``encode`` turns text into ids."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or len(prompt) != 1:
            raise InvalidField("prompt", f"a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids', "
                                         f"got keys {sorted(prompt)}")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise InvalidField("prompt", f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            prompt = prompt["prompt"]
        else:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple)):
                raise InvalidField("prompt_token_ids", "must be a list of token ids")
    if isinstance(prompt, str):
        _check_encodable("prompt", prompt)
        return list(encode(prompt))
    if isinstance(prompt, (list, tuple)):
        try:
            return [operator.index(t) for t in prompt]  # numpy ints pass, floats and bools' kin do not
        except TypeError:
            raise InvalidField("prompt_token_ids", "token ids must be integers") from None
    raise InvalidField("prompt", f"a prompt is a string, a list of token ids or a dict, "
                                 f"got {type(prompt).__name__}")


def prompt_text(prompt: Any) -> Optional[str]:
    """vLLM's ``RequestOutput.prompt``: the text a prompt was given as, None for token ids."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def as_prompt_list(prompts: Any) -> list:
    """One prompt given bare (a string, a dict, a list of ints) becomes a list of one."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and not isinstance(prompts[0], (str, dict, list, tuple)):
            return [prompts]  # token ids
        return list(prompts)
    raise InvalidField("prompts", f"expected a prompt or a list of prompts, got {type(prompts).__name__}")


def as_params_list(sampling: Any, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams for every prompt, or a list of one per prompt (an empty list is a
    length mismatch, as in vLLM, not the defaults)."""
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * num_prompts
    if len(params) != num_prompts:
        raise InvalidField("sampling_params", f"{len(params)} SamplingParams for {num_prompts} prompts: the "
                                              f"lengths of prompts and sampling_params must be the same")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"expected pagedserve.SamplingParams, got {type(p).__name__}")
    return params


def as_priority_list(priority: Any, num_prompts: int) -> list[int]:
    """vLLM's ``generate(..., priority=[...])``: one integer per prompt; None: every one 0."""
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, (str, bytes)) or not hasattr(priority, "__len__"):
        raise ValueError(f"priority: a list of one integer per prompt, got {type(priority).__name__}")
    values = list(priority)
    if len(values) != num_prompts:
        raise ValueError(f"priority: {len(values)} priorities for {num_prompts} prompts")
    for value in values:
        if type(value) is not int or not PRIORITY_MIN <= value <= PRIORITY_MAX:
            raise ValueError(f"priority: each must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {value!r}")
    return values


def as_per_prompt(name: str, value: Any, num_prompts: int, kind: type) -> list:
    """``max_queue_time_s`` / ``deadline_s`` / ``tenant``: one value for every prompt, or a list of one
    per prompt (None: none). Ranges are the protocol's (checked with the request)."""
    if value is None or isinstance(value, (kind, int) if kind is float else kind):
        values = [value] * num_prompts
    elif isinstance(value, (list, tuple)):
        values = list(value)
        if len(values) != num_prompts:
            raise ValueError(f"{name}: {len(values)} values for {num_prompts} prompts")
    else:
        raise ValueError(f"{name}: a {kind.__name__} or a list of one per prompt, got {type(value).__name__}")
    for item in values:
        ok = item is None or (isinstance(item, (int, float)) and not isinstance(item, bool) if kind is float
                              else isinstance(item, kind))
        if not ok:
            raise ValueError(f"{name}: each must be a {kind.__name__} or None, got {item!r}")
    return [float(v) if kind is float and v is not None else v for v in values]
