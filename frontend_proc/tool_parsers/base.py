"""What every tool-call parser returns: the content and the calls found in a (partial) output.

A parser is a pure function of the text generated so far. Streaming calls it after each
delta with ``final=False`` and sends what grew; the full response calls it once with
``final=True``. Because arguments are raw slices of the output, what a stream sent
concatenates to exactly what the full response holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Protocol

from pagedserve.frontend_proc.tool_parsers.json_scan import (
    ObjectScan, ScanError, decode_string, scan_object, skip_ws)


@dataclass(slots=True)
class PartialCall:
    name: Optional[str]  # None until the name's string is complete
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool = False  # the arguments value (and the name) are complete


@dataclass(slots=True)
class ParsedOutput:
    content: str  # the text for message.content (a prefix that only grows while streaming)
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(Protocol):
    def __call__(self, text: str, final: bool) -> ParsedOutput: ...


def call_from_object(text: str, scan: ObjectScan, argument_keys: tuple[str, ...]) -> PartialCall:
    """The call described by ``{"name": ..., "arguments": {...}}`` (keys in any order)."""
    name_span = scan.fields.get("name")
    name = None
    if name_span is not None and name_span.complete and text[name_span.start] == '"':
        name = decode_string(text, name_span)
    args_span = next((scan.fields[k] for k in argument_keys if k in scan.fields), None)
    arguments = "" if args_span is None else text[args_span.start:args_span.end]
    complete = (name is not None and args_span is not None and args_span.complete
                and scan.end is not None)
    return PartialCall(name, arguments, complete)


@dataclass(slots=True)
class CallScan:
    calls: list[PartialCall]
    end: int  # where the scan stopped (the text's length if the last call is still arriving)
    malformed: bool = False


def scan_calls(text: str, pos: int, argument_keys: tuple[str, ...],
               separator: Optional[str]) -> CallScan:
    """Call objects from ``pos`` on, joined by ``separator`` (None: just one)."""
    calls: list[PartialCall] = []
    while pos < len(text) and text[pos] == "{":
        try:
            scan = scan_object(text, pos)
            calls.append(call_from_object(text, scan, argument_keys))
        except ScanError:
            return CallScan(calls, pos, malformed=True)
        if scan.end is None:
            return CallScan(calls, len(text))
        pos = skip_ws(text, scan.end)
        if separator is None or not text.startswith(separator, pos):
            break
        pos = skip_ws(text, pos + len(separator))
    return CallScan(calls, pos, malformed=pos < len(text) and not calls)


def held_back(text: str, marker: str) -> int:
    """How many trailing characters could be the start of ``marker`` (kept from the content
    until the next delta says whether the marker follows)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
