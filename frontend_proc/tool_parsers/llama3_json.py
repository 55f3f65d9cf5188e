"""Llama 3.1+'s JSON tool calls: ``{"name": ..., "parameters": {...}}``, several joined by ``;``.

The output is calls only when it starts (after whitespace and an optional
``<|python_tag|>``) with ``{``; any other output is plain content.
"""

from __future__ import annotations

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, PartialCall, call_from_object
from pagedserve.frontend_proc.tool_parsers.json_scan import ScanError, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> ParsedOutput:
    pos = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = skip_ws(text, pos + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(text[pos:]):
        return ParsedOutput("")  # maybe the tag, maybe text: wait for more
    if pos >= len(text):
        return ParsedOutput(text if final else "")
    if text[pos] != "{":
        return ParsedOutput(text)
    calls: list[PartialCall] = []
    well_formed = True
    while pos < len(text):
        try:
            scan = scan_object(text, pos)
        except ScanError:
            well_formed = False
            break
        calls.append(call_from_object(text, scan, ("parameters", "arguments")))
        if scan.end is None:
            break
        pos = skip_ws(text, scan.end)
        if pos < len(text) and text[pos] == ";":
            pos = skip_ws(text, pos + 1)
        elif pos < len(text):
            well_formed = False
            break
    if final and (not well_formed or not all(c.complete for c in calls)):
        return ParsedOutput(text)
    return ParsedOutput("", calls)
