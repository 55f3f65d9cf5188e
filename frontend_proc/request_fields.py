"""Request fields no model declares: accepted only where they cannot change the output.

The request models (openai_schema.py) keep unknown fields (``model_extra``) rather than
failing in pydantic, so that this one place decides, with a reason a user can act on:
a field that only describes the caller (``metadata``) is accepted; a field at its
neutral value (``store: false``, ``modalities: ["text"]``) is accepted; ``null`` is taken as
omitted; anything else is a 400 naming the field. Never a field accepted and then ignored.
A field a model declares (tools, response_format, ... where supported) never reaches here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedserve.frontend_proc.errors import InvalidRequest

# They describe the caller or the account, not the completion (OpenAI's own words: "used to
# help detect abuse", "for storing additional information", "to cache responses for similar
# requests"): accepted with nothing to do.
# (``user`` is declared: it names the tenant, frontend_proc/tenant.py.)
ABOUT_THE_CALLER = frozenset({"metadata", "safety_identifier", "prompt_cache_key"})

NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "parallel_tool_calls": (True, False),  # meaningless without tools, which are refused
    "include_obfuscation": (False,),  # stream_options'
    "continuous_usage_stats": (False,),  # stream_options' (vLLM)
    "annotations": ([],),  # an assistant message sent back as OpenAI's client returned it
}

REASONS = {
    # OpenAI
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not configurable; chat_template_kwargs.enable_thinking false "
                        "switches Qwen3's thinking off",
    "verbosity": "verbosity is not configurable",
    "web_search_options": "web search is not supported",
    "store": "completions are not stored",
    "service_tier": "there is one service tier: auto",
    "moderation": "moderation is not supported",
    "prompt_cache_options": "the prefix cache is configured by the operator (--enable-prefix-caching)",
    "prompt_cache_retention": "the prefix cache is configured by the operator (--enable-prefix-caching)",
    # vLLM's extras
    "guided_json": "structured output is not supported",
    "guided_regex": "structured output is not supported",
    "guided_choice": "structured output is not supported",
    "guided_grammar": "structured output is not supported",
    "structured_outputs": "structured output is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "include_stop_str_in_output": "stop strings are always cut from the text",
    "truncate_prompt_tokens": "prompts are never truncated; a too long one is a 400",
    "allowed_token_ids": "use logit_bias",
    "bad_words": "use logit_bias",
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "logprobs tokens are always text",
    "cache_salt": "the prefix cache is shared by every request",
    "chat_template": "the chat template is set by the operator (--chat-template)",
    "documents": "documents for the chat template are not supported",
    "mm_processor_kwargs": "multimodal models are not supported",
    "kv_transfer_params": "disaggregated serving is not supported",
    "vllm_xargs": "no extra arguments are read",
    "echo": "chat does not echo the last message; /v1/completions has echo",
    "request_id": "the server names every request itself",
    "return_token_ids": "token ids are not returned; /tokenize gives a text's ids",
    "include_obfuscation": "stream chunks carry no obfuscation padding",
    "include_reasoning": "the thinking is always returned apart, as reasoning_content (--reasoning-parser)",
    "continuous_usage_stats": "usage comes once, in the final chunk (stream_options.include_usage)",
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer decodes them",
    "add_special_tokens": "prompts get the tokenizer's special tokens (chat: the template's)",
}


def refuse_unsupported_fields(body: BaseModel) -> None:
    """A 400 naming the first field this server would otherwise have to ignore: the request's
    own, its ``stream_options``', and those inside its messages (their content parts and earlier
    tool calls), tools and tool_choice."""
    _refuse(body, "", top_level=True)
    options = getattr(body, "stream_options", None)
    if isinstance(options, BaseModel):
        _refuse(options, "stream_options.")
    if options is not None and getattr(body, "stream", None) is False:
        raise InvalidRequest("stream_options is read only when stream is true", param="stream_options")
    metadata = (body.model_extra or {}).get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise InvalidRequest("metadata must be an object of string keys and string values", param="metadata")
    for i, message in enumerate(getattr(body, "messages", None) or ()):
        _refuse_in_message(message, f"messages[{i}].")
    for k, tool in enumerate(getattr(body, "tools", None) or ()):
        _refuse(tool, f"tools[{k}].")
        _refuse(tool.function, f"tools[{k}].function.")
    choice = getattr(body, "tool_choice", None)
    if isinstance(choice, BaseModel):
        _refuse(choice, "tool_choice.")
        _refuse(choice.function, "tool_choice.function.")


def _refuse_in_message(message: BaseModel, prefix: str) -> None:
    _refuse(message, prefix)
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            for name, value in part.items():
                if name not in ("type", "text") and value is not None:
                    raise InvalidRequest(f"{prefix}content[{j}].{name} is not supported: a text part has only "
                                         f"type and text", param=f"{prefix}content[{j}].{name}")
    for j, call in enumerate(message.tool_calls or ()):
        _refuse(call, f"{prefix}tool_calls[{j}].")
        _refuse(call.function, f"{prefix}tool_calls[{j}].function.")


def _refuse(body: BaseModel, prefix: str, top_level: bool = False) -> None:
    for name, value in (body.model_extra or {}).items():
        if value is None or (top_level and name in ABOUT_THE_CALLER):
            continue
        if any(type(value) is type(v) and value == v for v in NEUTRAL_VALUES.get(name, ())):
            continue  # the type too: 0 is not false here
        reason = REASONS.get(name, "it is not a field this server knows (a typo?)")
        raise InvalidRequest(f"{prefix}{name} is not supported: {reason}", param=prefix + name)
