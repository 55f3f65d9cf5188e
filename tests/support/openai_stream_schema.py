"""Streamed responses checked against OpenAI's published chunk schemas (no tests here).

schemathesis validates each SSE event object (``{"data": "...", "event": ...}``) against the
schema OpenAI documents for ``text/event-stream``, which describes the JSON *inside* ``data``:
no server can pass that literally. Here each event's data is parsed and validated instead.
Two readings of the document, both as OpenAI's own API behaves:
- the OpenAPI 3.0 ``nullable: true`` the document still uses means "or null";
- /completions documents no stream schema; its chunks share the full response's shape
  ("both the streamed and non-streamed response objects share the same shape"), with
  ``finish_reason`` null until a choice ends.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema

STREAM_SCHEMA = {"/chat/completions": "CreateChatCompletionStreamResponse",
                 "/completions": "CreateCompletionResponse"}


def _nullable_as_or_null(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _nullable_as_or_null(v) for k, v in node.items()}
        if node.pop("nullable", False):
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable_as_or_null(v) for v in node]
    return node


def stream_validator(openapi: dict, path: str) -> jsonschema.Draft202012Validator:
    root = _nullable_as_or_null(copy.deepcopy(openapi))
    schemas = root["components"]["schemas"]
    chunk = schemas[STREAM_SCHEMA[path]]
    if path == "/completions":
        finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
        chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
            "anyOf": [finish, {"type": "null"}]}
    return jsonschema.Draft202012Validator({**root, "$ref": f"#/components/schemas/{STREAM_SCHEMA[path]}"})


def stream_violations(validator: jsonschema.Draft202012Validator, body: str) -> list[str]:
    """Each `data:` event but the final [DONE], parsed and validated; the problems found."""
    problems = []
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        problems += [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                     for e in validator.iter_errors(event)]
    return problems


def pin_model(node: Any, name: str) -> None:
    """The spec accepts any model name; pin it to ours, or most requests test only the 404 path."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict) and "model" in props:
            props["model"] = {"type": "string", "enum": [name]}
        for value in node.values():
            pin_model(value, name)
    elif isinstance(node, list):
        for value in node:
            pin_model(value, name)
