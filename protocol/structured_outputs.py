"""A request's ``StructuredOutputs`` as an xgrammar ``Grammar``: the one reading of the wire
form for the frontends (which refuse a bad grammar before sending it) and the scheduler
(which compiles the grammar against the tokenizer and owns the matchers).

No tokenizer is needed here, so a frontend checks a grammar in a few milliseconds. xgrammar
(and with it torch) is imported on first use only.

JSON is compact: with any whitespace allowed, a model can pad an object forever, and a
noisy one does (docs/DECISIONS.md, "Structured output").
"""

from __future__ import annotations

import importlib
import json
import re
import threading

from pagedserve.protocol.json_schema_support import unenforceable
from pagedserve.protocol.messages import StructuredOutputs
from pagedserve.protocol.validate import InvalidField, check_structured_outputs

# xgrammar 0.2.8 writes length-bounded strings with this class, which admits raw control
# characters; JSON forbids them (json.loads refuses the text), so they are excluded.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[06:32:29] /project/cpp/grammar_parser.cc:820: "
ANY_JSON_OBJECT = '{"type": "object"}'


def preload_in_background() -> None:
    """Import xgrammar (seconds: it brings torch) in a thread now, so the first constrained
    request does not stall a frontend's event loop on it."""
    threading.Thread(target=importlib.import_module, args=("xgrammar",), name="xgrammar-import",
                     daemon=True).start()


def json_schema_ebnf(schema: str) -> str:
    """The EBNF of ``schema`` (JSON Schema text): compact, with strings JSON parsers accept."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices``, each taken literally."""
    return "(" + "|".join("".join("\\" + ch if ch in "\\.^$|?*+()[]{}/-" else ch for ch in choice)
                          for choice in choices) + ")"


def build_grammar(spec: StructuredOutputs):
    """``spec`` as an xgrammar Grammar; raises InvalidField("structured_outputs", ...) naming
    the kind and the problem."""
    import xgrammar

    check_structured_outputs(spec)
    kind = spec.kinds_set()[0]
    try:
        if kind == "json":
            schema = json.loads(spec.json)
            if not isinstance(schema, dict):
                raise ValueError("a JSON Schema must be a JSON object")
            why = unenforceable(schema)
            if why is not None:
                raise InvalidField("structured_outputs", f"json: {why}")
            return xgrammar.Grammar.from_ebnf(json_schema_ebnf(spec.json))
        if kind == "json_object":
            return xgrammar.Grammar.from_ebnf(json_schema_ebnf(ANY_JSON_OBJECT))
        if kind == "regex":
            return xgrammar.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgrammar.Grammar.from_regex(choice_regex(spec.choice))
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    except InvalidField:
        raise
    except (ValueError, RuntimeError, TypeError) as exc:  # xgrammar's parse errors, json's
        text = _LOG_PREFIX.sub("", (str(exc).strip() or type(exc).__name__).splitlines()[0])[:500]
        raise InvalidField("structured_outputs", f"{kind} cannot be compiled: {text}") from None


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs_from_dict(value: dict, field: str = "structured_outputs") -> StructuredOutputs:
    """vLLM's ``structured_outputs`` object ({"json": schema (dict or text)} or one of
    ``regex``, ``choice``, ``grammar``, ``json_object``) as the wire form; InvalidField names
    anything else."""
    if not isinstance(value, dict):
        raise InvalidField(field, f"must be an object with one of {', '.join(_KINDS)}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KINDS))
    if unknown:
        raise InvalidField(field, f"unsupported key(s) {unknown}; supported: {', '.join(_KINDS)}")
    set_values = {key: v for key, v in value.items() if v is not None and v is not False}
    schema = set_values.get("json")
    if schema is not None and not isinstance(schema, str):
        if not isinstance(schema, dict):
            raise InvalidField(field, "json must be a JSON Schema (an object, or its text)")
        set_values["json"] = json.dumps(schema)
    if "json_object" in set_values and set_values["json_object"] is not True:
        raise InvalidField(field, "json_object must be true or false")
    for key in ("regex", "grammar"):
        if key in set_values and not isinstance(set_values[key], str):
            raise InvalidField(field, f"{key} must be a string")
    choice = set_values.get("choice")
    if choice is not None and (not isinstance(choice, list) or not all(isinstance(c, str) for c in choice)):
        raise InvalidField(field, "choice must be a list of strings")
    spec = StructuredOutputs(**set_values)
    try:
        check_structured_outputs(spec)
    except InvalidField as exc:
        raise InvalidField(field, exc.reason) from None
    return spec
