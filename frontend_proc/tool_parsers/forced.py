"""The outputs of forced tool choices, whose shape the grammar guarantees.

- named function: the whole output is the arguments object;
- ``"required"``: a JSON array of ``{"name": ..., "arguments": {...}}``, at least one.
Truncated output (max_tokens) yields the calls as far as they got.
"""

from __future__ import annotations

from pagedserve.frontend_proc.tool_parsers.base import (
    ParsedOutput, PartialCall, ToolParser, scan_calls, valid_json)
from pagedserve.frontend_proc.tool_parsers.json_scan import skip_ws


def named_call_parser(name: str) -> ToolParser:
    def parse(text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [PartialCall(name, text, final and valid_json(text))])
    return parse


def parse_call_array(text: str, final: bool) -> ParsedOutput:
    pos = skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        return ParsedOutput(text if final else "")
    return ParsedOutput("", scan_calls(text, skip_ws(text, pos + 1), ("arguments", "parameters"), ",").calls)
