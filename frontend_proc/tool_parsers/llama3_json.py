"""Llama 3.1+'s JSON tool calls: ``{"name": ..., "parameters": {...}}``, several joined by ``;``.

The output is calls only when it starts (after whitespace and an optional
``<|python_tag|>``) with ``{``; any other output is plain content.
"""

from __future__ import annotations

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, scan_calls
from pagedserve.frontend_proc.tool_parsers.json_scan import skip_ws

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
    scan = scan_calls(text, pos, ("parameters", "arguments"), separator=";")
    if final and (scan.malformed or scan.end < len(text) or not all(c.complete for c in scan.calls)):
        return ParsedOutput(text)
    return ParsedOutput("", scan.calls)
