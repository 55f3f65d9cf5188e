"""JSON Schema keywords the grammar engine cannot enforce, refused before a schema is compiled.

xgrammar 0.2 compiles a schema holding ``uniqueItems``, ``contains``, ``not``, ``if``/``then``,
``dependentRequired``, ``unevaluatedProperties`` or an ``allOf`` of several schemas as if the
keyword were absent (``contains`` even as "the empty array only"), and a ``pattern`` with a
lookaround as if the pattern allowed more. A request answered "stop" would then break its own
schema. vLLM's xgrammar backend refuses most of these too; the rule here is the project's:
honour a field or refuse it with a 400 naming it.

Only keyword positions are read: ``properties`` maps names (which may be "not" or "if") to
schemas, and ``enum``, ``const``, ``default`` and ``examples`` hold data, not schemas.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional

_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
               "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
_SCHEMAS = ("additionalProperties", "items", "additionalItems", "propertyNames")  # schema (items: or a list)


def unenforceable(schema: Any) -> Optional[str]:
    """Why ``schema`` (parsed JSON) cannot be enforced as written, naming the keyword and where
    it sits (a JSON pointer), or None."""
    for pointer, node in _subschemas(schema, ""):
        where = pointer or "/"
        for keyword in _UNENFORCED:
            if keyword in node:
                return f"JSON Schema keyword {keyword!r} (at {where}) cannot be enforced; remove it"
        if node.get("uniqueItems") is True:
            return f"JSON Schema keyword 'uniqueItems' (at {where}) cannot be enforced; remove it"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of {len(node['allOf'])} schemas (at {where}) cannot be enforced; merge them into one"
        patterns = [node.get("pattern")] + list((node.get("patternProperties") or {}).keys())
        for pattern in patterns:
            if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
                return f"the pattern {pattern[:80]!r} (at {where}) has a lookaround, which cannot be enforced"
    return None


def _subschemas(node: Any, pointer: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield pointer, node
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield from _subschemas(child, f"{pointer}/{key}/{_escape(name)}")
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield from _subschemas(child, f"{pointer}/{key}/{i}")
    for key in _SCHEMAS:
        child = node.get(key)
        if isinstance(child, list):
            for i, item in enumerate(child):
                yield from _subschemas(item, f"{pointer}/{key}/{i}")
        else:
            yield from _subschemas(child, f"{pointer}/{key}")


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
