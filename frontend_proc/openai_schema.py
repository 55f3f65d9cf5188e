"""Pydantic models of the OpenAI request bodies we accept (undeclared fields are kept, for
request_fields.py to judge).

Strict mode: a string where a number belongs is a 400, not a silent coercion.
"""

from __future__ import annotations

import re

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from pagedserve.client.chat_messages import ChatMessage, Lenient as _Lenient
from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.protocol.priority import MAX_LIMIT_S, PRIORITY_MAX, PRIORITY_MIN
from pagedserve.protocol.validate import unencodable_string

MAX_N = 128
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default; a deployment may set another


class EncodableStrings(BaseModel):
    """A request body whose every string, declared field or not, UTF-8 can encode: checked once,
    on the raw body, so a lone surrogate is a 400 naming its field wherever it hides."""

    @model_validator(mode="before")
    @classmethod
    def _strings_are_encodable(cls, data: Any) -> Any:
        found = unencodable_string(data)
        if found:  # not a ValueError: pydantic lets it through to the route's 400 handler
            raise InvalidRequest(f"{found[0]}: {found[1]}", param=found[0])
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: Optional[str] = None
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute: kept under another name, read by its JSON name
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced strictly (structured_request.py)


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class SamplingFields(_Lenient):
    """Fields common to /v1/completions and /v1/chat/completions (vLLM names for extras)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, gt=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    seed: Optional[int] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=2.0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias in [-100, 100]
    best_of: Optional[int] = Field(default=None, ge=1)  # only best_of == n (no extra candidates)
    skip_special_tokens: bool = True  # vLLM's: False renders special tokens in the text
    # vLLM's: the prompt tokens' logprobs with this many alternatives (<= --max-logprobs, and not
    # with stream, as vLLM; checked in serving). Skips the prefix cache (DECISIONS.md).
    prompt_logprobs: Optional[int] = Field(default=None, ge=0)
    # vLLM's: lower runs first; non-zero only with --scheduling-policy priority (serving checks)
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # Seconds from arrival: the most it may wait for a first token (with --max-queue-time-s, the
    # smaller wins), and the most its whole generation may take (protocol/priority.py)
    max_queue_time_s: Optional[float] = Field(default=None, gt=0, le=MAX_LIMIT_S)
    deadline_s: Optional[float] = Field(default=None, gt=0, le=MAX_LIMIT_S)
    user: Optional[str] = None  # OpenAI's end-user id: the tenant, unless --tenant-header names one (tenant.py)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # Structured output (frontend_proc/structured_request.py): OpenAI's, and vLLM's extras
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None  # refused: JSON is always compact

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _whitespace_pattern_unsupported(cls, value: Optional[str]):
        if value is not None:
            raise ValueError("guided_whitespace_pattern is not supported: JSON output is compact")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings_are_not_empty(cls, value: Optional[Union[str, list[str]]]):
        strings = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids_and_range(cls, value: Optional[dict[str, float]]):
        seen: dict[int, str] = {}
        for key, bias in (value or {}).items():
            # ASCII digits only: str.isdigit() takes "²" and "①", which int() then refuses (a 500)
            if not re.fullmatch(r"[0-9]+", key.strip()):
                raise ValueError(f"logit_bias keys are token ids as strings, got {key!r}")
            if int(key) in seen:  # "5" and "05": one of the two biases would be dropped
                raise ValueError(f"logit_bias names token {int(key)} twice: {seen[int(key)]!r} and {key!r}")
            seen[int(key)] = key
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

    def token_logit_bias(self) -> dict[int, float]:
        return {int(key): float(bias) for key, bias in (self.logit_bias or {}).items()}

    def num_top_logprobs(self) -> int:
        """How many alternatives per token were asked for (0: the sampled token only)."""
        return 0

    def echo_logprobs(self) -> Optional[int]:
        """Alternatives per echoed prompt token; None: the prompt's logprobs are not echoed."""
        return None

    def wire_prompt_logprobs(self) -> Optional[int]:
        """Alternatives per prompt token the engine computes, for prompt_logprobs and echo."""
        wanted = [k for k in (self.prompt_logprobs, self.echo_logprobs()) if k is not None]
        return max(wanted) if wanted else None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_PROMPTS = 256  # prompts in one /v1/completions request (each of them n choices)


class CompletionRequest(SamplingFields, EncodableStrings):
    # One prompt (text or token ids) or a list of them; choices are numbered prompt-major.
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0)  # <= --max-logprobs, checked in serving
    echo: bool = False  # the prompt's text (and with logprobs its tokens' logprobs) before each choice's
    suffix: Optional[str] = None  # refused: no insertion (fill-in-the-middle) mode

    @field_validator("prompt")
    @classmethod
    def _prompts_are_not_empty(cls, value: Any):
        if isinstance(value, list) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
            if any(len(p) == 0 for p in value):
                raise ValueError("no prompt in the list may be empty")
        elif len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix_unsupported(cls, value: Optional[str]):
        if value is not None:
            raise ValueError("suffix is not supported: this server has no insertion mode")
        return value

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one per choice group."""
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def echo_logprobs(self) -> Optional[int]:
        return self.logprobs if self.echo else None


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # JSON Schema of the arguments object
    strict: Optional[bool] = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, EncodableStrings):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ToolDefinition]] = None
    # None: "auto" with tools, "none" without (OpenAI's default); frontend_proc/tool_choice.py
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    # vLLM's chat template controls (client/chat_template_options.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # OpenAI's deprecated single-function form: refused, pointing at tools / tool_choice
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy_functions_unsupported(cls, value: Any, info: Any):
        if value is not None:
            replacement = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"{info.field_name} is the deprecated form; use {replacement}")
        return value
    max_completion_tokens: Optional[int] = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0)  # <= --max-logprobs, checked in serving

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0
