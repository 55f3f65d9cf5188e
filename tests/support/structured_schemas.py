"""Schemas, a regex and choices the structured-output tests ask for, bounded so that even a
noisy model's output must end (every string, array and number has a limit)."""

from __future__ import annotations

import json
import re

import jsonschema

SCHEMAS = {
    "person": {  # nested object, enum, bounded integers, array, optional fields, required ones
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 5},
                                       "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                        "required": ["city", "zip"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "address"],
        "additionalProperties": False,
    },
    "points": {  # an array of objects
        "type": "array",
        "items": {"type": "object",
                  "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                 "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x", "y"], "additionalProperties": False},
        "minItems": 1, "maxItems": 3,
    },
    "reading": {  # numbers with bounds, a nullable field
        "type": "object",
        "properties": {"value": {"type": "number", "minimum": -1.5, "maximum": 2.25},
                       "unit": {"enum": ["m", "s", "kg"]},
                       "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]}},
        "required": ["value", "unit", "note"],
        "additionalProperties": False,
    },
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]


def check_json(text: str, schema_name: str) -> None:
    """The text parses as JSON (as any client would parse it) and validates against the schema."""
    jsonschema.validate(json.loads(text), SCHEMAS[schema_name])


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def check_choice(text: str) -> None:
    assert text in CHOICES, text
