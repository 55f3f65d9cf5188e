"""Pythonic calls (Llama 3.2 / 4, ToolACE and others): the output is a Python list of calls,
``[get_weather(city="Paris"), get_time()]``, keyword arguments with literal values.

An output that starts (after whitespace) with ``[`` is calls; any other is content. Arguments
are the keyword literals as a JSON object, known once a call's closing parenthesis arrives, so a
stream announces each call whole. A complete output that is not such a list is content (vLLM).
"""

from __future__ import annotations

import ast
import json
from typing import Optional

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, PartialCall

_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _call(source: str) -> Optional[PartialCall]:
    """One ``name(key=literal, ...)`` as a call; None if it is not one."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(arguments) != len(node.keywords):
            return None
        return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False), complete=True)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _top_level_items(text: str, start: int) -> tuple[list[str], bool, int]:
    """The complete comma-separated items of the list opened at ``start``, whether it closed,
    and where the scan stopped."""
    items, stack, quote, item_start, i = [], [], None, start + 1, start + 1
    while i < len(text):
        char = text[i]
        if quote is not None:
            if char == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif char in "'\"":
            quote = char * 3 if text.startswith(char * 3, i) else char
            i += len(quote) - 1
        elif char in _CLOSERS:
            stack.append(_CLOSERS[char])
        elif char in ")]}":
            if not stack:
                if char != "]":
                    return items, False, i
                if text[item_start:i].strip():
                    items.append(text[item_start:i])
                return items, True, i + 1
            if stack.pop() != char:
                return items, False, i
        elif char == "," and not stack:
            items.append(text[item_start:i])
            item_start = i + 1
        i += 1
    return items, False, len(text)


def parse_pythonic(text: str, final: bool) -> ParsedOutput:
    stripped = text.lstrip()
    if not stripped:
        return ParsedOutput(text if final else "")
    if not stripped.startswith("["):
        return ParsedOutput(text)
    items, closed, end = _top_level_items(text, len(text) - len(stripped))
    calls = [_call(item) for item in items]
    if final:
        if not closed or text[end:].strip() or not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput("", calls)  # type: ignore[arg-type]
    parsed = []
    for call in calls:
        if call is None:
            break
        parsed.append(call)
    return ParsedOutput("", parsed)
