"""The outputs of forced tool choices, whose shape the grammar guarantees.

- named function: the whole output is the arguments object;
- ``"required"``: a JSON array of ``{"name": ..., "arguments": {...}}``, at least one.
Truncated output (max_tokens) yields the calls as far as they got.
"""

from __future__ import annotations

from pagedserve.frontend_proc.tool_parsers.base import (
    ParsedOutput, PartialCall, ToolParser, call_from_object, valid_json)
from pagedserve.frontend_proc.tool_parsers.json_scan import ScanError, scan_object, skip_ws


def named_call_parser(name: str) -> ToolParser:
    def parse(text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [PartialCall(name, text, final and valid_json(text))])
    return parse


def parse_call_array(text: str, final: bool) -> ParsedOutput:
    calls: list[PartialCall] = []
    pos = skip_ws(text, 0)
    if pos >= len(text):
        return ParsedOutput("", calls)
    if text[pos] != "[":
        return ParsedOutput(text if final else "", calls)
    pos = skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] == "{":
        try:
            scan = scan_object(text, pos)
        except ScanError:
            break
        calls.append(call_from_object(text, scan, ("arguments", "parameters")))
        if scan.end is None:
            break
        pos = skip_ws(text, scan.end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(text, pos + 1)
    return ParsedOutput("", calls)
