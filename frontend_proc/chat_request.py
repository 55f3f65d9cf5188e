"""A chat request made ready to generate: its prompt (template options and tools applied), the
grammar a forced tool choice needs, and how its choices are rendered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from pagedserve.frontend_proc.chat_template_options import ChatTemplateOptions
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest
from pagedserve.frontend_proc.response_format import ChatFormat
from pagedserve.frontend_proc.tokenization import PromptTokenizer
from pagedserve.frontend_proc.tool_call_output import ToolCallChoices
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig, plan_tool_calls
from pagedserve.protocol.messages import StructuredOutputs


@dataclass(slots=True)
class ChatPrompt:
    prompt_ids: list[int]
    structured_outputs: Optional[StructuredOutputs]  # set by a forced tool choice
    choices: Union[ChatFormat, ToolCallChoices]  # full_choice / chunk_choice for the response


def prepare_chat(body: ChatCompletionRequest, tokenizer: PromptTokenizer,
                 tool_calling: ToolCallingConfig, fmt: ChatFormat) -> ChatPrompt:
    plan = plan_tool_calls(body, tool_calling)
    options = ChatTemplateOptions.from_request(
        body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
        plan.template_tools)
    prompt_ids = tokenizer.encode_chat(body.messages, options)
    choices = fmt if plan.parser is None else ToolCallChoices(
        fmt, plan.parser, body.n, plan.parallel_tool_calls)
    return ChatPrompt(prompt_ids, plan.structured_outputs, choices)
