"""A chat request made ready to generate: its prompt (template options and tools applied), the
grammar a forced tool choice needs, and how its choices are rendered (tool calls parsed from the
content, the reasoning split off first when --reasoning-parser is set).

Structured output with a reasoning parser, as vLLM: the thinking is free text and the grammar
(response_format, guided_*, or a forced tool choice) starts after the token that ends it. The
request carries the end tag's token ids (``StructuredOutputs.start_after``) and the scheduler
starts the matcher once the output has generated them. That needs ``</think>`` to be one token,
as in every reasoning model's tokenizer (vLLM's parsers require it too): a tag in several pieces
could be written in other pieces than its encoding, and the content would then go unconstrained
while the request asked for it; such a tokenizer keeps the 400 naming the field. With the thinking
switched off (Qwen3's ``enable_thinking: false``, or a template that closes it in the prompt) the
whole output is content and the grammar applies from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import msgspec

from pagedserve.client.chat_template_options import ChatTemplateOptions
from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest
from pagedserve.frontend_proc.reasoning import ReasoningParser
from pagedserve.frontend_proc.reasoning.think_tags import END, START
from pagedserve.frontend_proc.reasoning.output import ReasoningChoices
from pagedserve.frontend_proc.response_format import ChatFormat
from pagedserve.frontend_proc.structured_request import (
    check_grammar, structured_output_field, structured_outputs_of)
from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.tool_call_output import ToolCallChoices
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig, plan_tool_calls
from pagedserve.protocol.messages import StructuredOutputs
from pagedserve.protocol.validate import InvalidField


@dataclass(slots=True)
class ChatPrompt:
    prompt_ids: list[int]
    structured_outputs: Optional[StructuredOutputs]  # response_format's, guided_*'s, or a forced tool call's
    choices: Union[ChatFormat, ToolCallChoices, ReasoningChoices]  # full_choice / chunk_choice


def prepare_chat(body: ChatCompletionRequest, tokenizer: PromptTokenizer,
                 tool_calling: ToolCallingConfig, fmt: ChatFormat,
                 reasoning: Optional[ReasoningParser] = None) -> ChatPrompt:
    plan = plan_tool_calls(body, tool_calling)
    options = ChatTemplateOptions.from_request(
        body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
        plan.template_tools)
    if plan.structured_outputs is not None:
        _check_forced_call_grammar(body, plan.structured_outputs)
    prompt_ids = tokenizer.encode_chat(body.messages, options)
    choices = fmt if plan.parser is None else ToolCallChoices(
        fmt, plan.parser, body.n, plan.parallel_tool_calls, calls_as_they_grow=plan.structured_outputs is not None)
    structured = plan.structured_outputs or structured_outputs_of(body)
    if reasoning is not None and _starts_in_reasoning(body, tokenizer, prompt_ids, options, reasoning):
        end_ids = tokenizer.tokenizer.encode(END, add_special_tokens=False)
        structured = _after_thinking(body, structured, plan.structured_outputs is not None, end_ids, reasoning)
        choices = ReasoningChoices(fmt, choices, reasoning, body.n, end_ids)
    return ChatPrompt(prompt_ids, structured, choices)


def _starts_in_reasoning(body: ChatCompletionRequest, tokenizer: PromptTokenizer, prompt_ids: list[int],
                         options: ChatTemplateOptions, reasoning: ReasoningParser) -> bool:
    """Whether the output begins inside the thinking. A continued final message (a prefill) ends
    the prompt with its own text, so that text says: inside only after an unclosed <think>."""
    if options.continue_final_message:
        final = body.messages[-1].text()
        return final.rfind(START) > final.rfind(END)
    tail = tokenizer.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return reasoning.starts_in_reasoning(tail, options.template_kwargs)


def _after_thinking(body: ChatCompletionRequest, spec: Optional[StructuredOutputs], forced: bool,
                    end_ids: list[int], reasoning: ReasoningParser) -> Optional[StructuredOutputs]:
    """The request's grammar, if any, set to start after the end of the thinking (``end_ids``)."""
    if spec is None:
        return None
    if len(end_ids) != 1:
        field = "tool_choice" if forced else structured_output_field(body)
        switch = ("switch the thinking off (chat_template_kwargs.enable_thinking false; Responses: reasoning.effort "
                  "\"none\"; Anthropic: thinking.type \"disabled\"), or " if reasoning.reads_enable_thinking else "")
        raise InvalidRequest(f"{field}: structured output cannot start where the thinking ends "
                             f"(--reasoning-parser {reasoning.name}): this model's tokenizer writes {END} in "
                             f"{len(end_ids)} tokens, not one; {switch}drop {field}", param=field)
    return msgspec.structs.replace(spec, start_after=end_ids)


def _check_forced_call_grammar(body: ChatCompletionRequest, grammar: StructuredOutputs) -> None:
    """A forced tool choice is the request's one grammar, built from the tools' schemas."""
    if structured_outputs_of(body) is not None:
        raise InvalidRequest("tool_choice forces a tool call, so the output cannot also follow "
                             "response_format (or structured_outputs / guided_*); send one of them",
                             param="tool_choice")
    try:
        check_grammar(grammar)
    except InvalidField as exc:
        raise InvalidRequest(f"tools: a function's parameters schema cannot be enforced: {exc.reason}",
                             param="tools") from None
