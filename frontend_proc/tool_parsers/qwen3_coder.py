"""Qwen3-Coder's XML-like calls: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
</function></tool_call>``.

Content is the text before the first ``<tool_call>``. A value is raw text (one leading and one
trailing newline dropped, as the model writes them); it is typed by the tool's parameter schema
when the request gave one (string stays text; integer, number, boolean, object, array are
parsed), else read as JSON when it is JSON and kept as text otherwise, as vLLM converts them.
The arguments object grows one complete parameter at a time, so a stream sends prefixes of the
final JSON. A complete output whose blocks do not all hold a closed function is returned whole
as content, with no calls (the hermes rule).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pagedserve.frontend_proc.tool_parsers.base import ParsedOutput, PartialCall, held_back

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# function name -> its parameters' JSON Schema "properties"
ParameterSchemas = dict[str, dict[str, Any]]


def _typed(raw: str, schema: Optional[dict[str, Any]]) -> Any:
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    kind = (schema or {}).get("type")
    if kind == "string":
        return value
    if value.strip().lower() == "null":
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    if kind == "boolean" and isinstance(parsed, str):
        return parsed.strip().lower() == "true" if parsed.strip().lower() in ("true", "false") else parsed
    return parsed


def _function(text: str, pos: int, schemas: ParameterSchemas) -> tuple[Optional[PartialCall], int]:
    """The call whose ``<function=`` is at ``pos``, and where its block ends (len: incomplete)."""
    name_end = text.find(">", pos)
    if name_end < 0:
        return None, len(text)
    name = text[pos + len(FUNCTION):name_end].strip()
    properties = schemas.get(name, {})
    members: list[str] = []
    cursor = name_end + 1
    while True:
        param = text.find(PARAMETER, cursor)
        close = text.find(FUNCTION_END, cursor)
        if close >= 0 and (param < 0 or close < param):
            arguments = "{" + ", ".join(members) + "}"
            return PartialCall(name, arguments, complete=True), close + len(FUNCTION_END)
        if param < 0:
            return PartialCall(name, "{" + ", ".join(members)), len(text)
        key_end = text.find(">", param)
        value_end = text.find(PARAMETER_END, key_end) if key_end >= 0 else -1
        if value_end < 0:
            return PartialCall(name, "{" + ", ".join(members)), len(text)
        key = text[param + len(PARAMETER):key_end].strip()
        value = _typed(text[key_end + 1:value_end], properties.get(key))
        members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        cursor = value_end + len(PARAMETER_END)


def qwen3_coder_parser(schemas: Optional[ParameterSchemas] = None):
    schemas = schemas or {}

    def parse(text: str, final: bool) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(text if final else text[:len(text) - held_back(text, START)])
        calls: list[PartialCall] = []
        well_formed, start = True, first
        while start >= 0:
            pos = text.find(FUNCTION, start + len(START))
            if pos < 0:
                well_formed = not text[start + len(START):].strip() and not final
                break
            call, end = _function(text, pos, schemas)
            if call is None:
                break
            calls.append(call)
            if end >= len(text):
                break
            start = text.find(START, end)
        if final and (not well_formed or not calls or not all(c.complete for c in calls)):
            return ParsedOutput(text)
        return ParsedOutput(text[:first], calls)

    return parse


parse_qwen3_coder = qwen3_coder_parser()
