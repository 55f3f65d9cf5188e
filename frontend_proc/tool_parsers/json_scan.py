"""A scanner for JSON that may still be arriving: where each value of an object starts and ends.

Tool calls are streamed while the model writes them, so the parsers need the raw extent of
``"arguments": {...}`` before its closing brace exists. The scanner never re-serializes:
an argument string streamed piece by piece is exactly the slice a complete parse returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

_WHITESPACE = " \t\r\n"
_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsn")  # numbers, true, false, null


class ScanError(ValueError):
    """The text is not (the beginning of) JSON of the expected shape."""


@dataclass(slots=True)
class Span:
    start: int
    end: int  # exclusive; the text's length while the value is incomplete
    complete: bool


@dataclass(slots=True)
class ObjectScan:
    fields: dict[str, Span] = field(default_factory=dict)
    end: Optional[int] = None  # just past the closing brace; None while incomplete


def decode_string(text: str, span: Span) -> str:
    """The value of a complete JSON string (a bad escape makes the text not JSON)."""
    try:
        return json.loads(text[span.start:span.end])
    except ValueError:
        raise ScanError(f"bad string at {span.start}") from None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _scan_string(text: str, pos: int) -> Span:
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return Span(pos, i + 1, True)
        i += 1
    return Span(pos, len(text), False)


def _scan_container(text: str, pos: int) -> Span:
    closers = []
    i = pos
    while i < len(text):
        char = text[i]
        if char == '"':
            string = _scan_string(text, i)
            if not string.complete:
                break
            i = string.end
            continue
        if char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]":
            if not closers or closers.pop() != char:
                raise ScanError(f"unbalanced {char!r} at {i}")
            if not closers:
                return Span(pos, i + 1, True)
        i += 1
    return Span(pos, len(text), False)


def scan_value(text: str, pos: int) -> Span:
    """The extent of the JSON value starting at ``pos`` (no leading whitespace)."""
    if pos >= len(text):
        return Span(pos, pos, False)
    char = text[pos]
    if char == '"':
        return _scan_string(text, pos)
    if char in "{[":
        return _scan_container(text, pos)
    end = pos
    while end < len(text) and text[end] in _SCALAR_CHARS:
        end += 1
    if end == pos:
        raise ScanError(f"no JSON value at {pos}: {text[pos:pos + 10]!r}")
    return Span(pos, end, end < len(text))


def scan_object(text: str, pos: int) -> ObjectScan:
    """The members of the object at ``pos`` seen so far (keys complete, values maybe not)."""
    if pos >= len(text) or text[pos] != "{":
        raise ScanError(f"expected an object at {pos}")
    scan = ObjectScan()
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] == "}":
            scan.end = pos + 1
            return scan
        if text[pos] != '"':
            raise ScanError(f"expected a key at {pos}")
        key = _scan_string(text, pos)
        if not key.complete:
            return scan
        pos = skip_ws(text, key.end)
        if pos >= len(text):
            return scan
        if text[pos] != ":":
            raise ScanError(f"expected ':' at {pos}")
        pos = skip_ws(text, pos + 1)
        if pos >= len(text):
            return scan
        value = scan_value(text, pos)
        scan.fields[decode_string(text, key)] = value
        if not value.complete:
            return scan
        pos = skip_ws(text, value.end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "}":
            raise ScanError(f"expected ',' or '}}' at {pos}")
    return scan
