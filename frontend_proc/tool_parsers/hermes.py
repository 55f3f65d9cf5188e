"""The hermes format (Qwen2.5, Hermes, and others): ``<tool_call>{"name", "arguments"}</tool_call>``.

Content is the text before the first ``<tool_call>``. A complete output whose call blocks do
not all hold a well-formed call is returned whole as content, with no calls (vLLM's rule).
"""

from __future__ import annotations

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, PartialCall, held_back, scan_calls
from pagedserve.frontend_proc.tool_parsers.json_scan import skip_ws

START = "<tool_call>"
END = "</tool_call>"


def parse_hermes(text: str, final: bool) -> ParsedOutput:
    first = text.find(START)
    if first < 0:
        return ParsedOutput(text if final else text[:len(text) - held_back(text, START)])
    calls: list[PartialCall] = []
    well_formed = True
    start = first
    while start >= 0:
        pos = skip_ws(text, start + len(START))
        if pos >= len(text):
            break
        scan = scan_calls(text, pos, ("arguments", "parameters"), separator=None)
        calls.extend(scan.calls)
        if scan.malformed or not scan.calls:
            well_formed = False
            break
        if scan.end >= len(text):
            break
        if not text.startswith(END, scan.end) and not END.startswith(text[scan.end:]):
            well_formed = False
            break
        start = text.find(START, scan.end)
    if final and (not well_formed or not calls or not all(c.complete for c in calls)):
        return ParsedOutput(text)
    return ParsedOutput(text[:first], calls)
