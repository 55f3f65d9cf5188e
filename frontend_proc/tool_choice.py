"""What a chat request's ``tools`` and ``tool_choice`` mean for its prompt, its grammar and
the parsing of its output (vLLM's rules).

- no ``tool_choice``: ``"auto"`` when tools are given, else ``"none"``;
- ``"none"``: the template still sees the tools; the output is plain text;
- ``"auto"``: the output is parsed by ``--tool-call-parser``; needs ``--enable-auto-tool-choice``
  (without it, a 400 that says so);
- ``"required"``: the output is constrained to a JSON array of one or more
  ``{"name", "arguments"}`` calls of the given tools (at most one with
  ``parallel_tool_calls: false``);
- a named function: the output is constrained to that function's arguments object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, ToolDefinition
from pagedserve.frontend_proc.tool_parsers import ToolParser, get_tool_parser
from pagedserve.frontend_proc.tool_parsers.forced import named_call_parser, parse_call_array
from pagedserve.protocol.messages import StructuredOutputs

# OpenAI: a function without parameters takes none, so its arguments are the empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolCallingConfig:
    """The deployment's ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at startup
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    template_tools: Optional[list[dict[str, Any]]] = None  # what the chat template is shown
    structured_outputs: Optional[StructuredOutputs] = None  # the forced-choice grammar
    parser: Optional[ToolParser] = None  # None: the output is plain content
    parallel_tool_calls: bool = True


def arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def required_calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each one of the tools by name with its own arguments schema."""
    one_call = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                "arguments": arguments_schema(t)},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": one_call[0] if len(one_call) == 1 else {"anyOf": one_call}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tool_calls(body: ChatCompletionRequest, config: ToolCallingConfig) -> ToolPlan:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise InvalidRequest("tool_choice needs tools: give the functions in tools",
                                 param="tool_choice")
        return ToolPlan(parallel_tool_calls=body.parallel_tool_calls)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools: function names must be unique, got {names}", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    parallel = body.parallel_tool_calls
    if choice == "none":
        return ToolPlan(template_tools, parallel_tool_calls=parallel)
    if choice == "auto":
        if not config.enable_auto_tool_choice:
            raise InvalidRequest('"auto" tool choice requires --enable-auto-tool-choice and '
                                 '--tool-call-parser to be set; or set tool_choice to "none", '
                                 '"required" or a named function', param="tool_choice")
        schemas = {t.function.name: arguments_schema(t).get("properties") or {} for t in tools}
        return ToolPlan(template_tools, None, get_tool_parser(config.tool_call_parser, schemas), parallel)
    if choice == "required":
        schema = required_calls_schema(tools, parallel)
        return ToolPlan(template_tools, StructuredOutputs(json=json.dumps(schema)),
                        parse_call_array, parallel)
    named = next((t for t in tools if t.function.name == choice.function.name), None)
    if named is None:
        raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is "
                             f"not among the tools {names}", param="tool_choice")
    return ToolPlan(template_tools, StructuredOutputs(json=json.dumps(arguments_schema(named))),
                    named_call_parser(named.function.name), parallel)
