"""The JSON Schema keywords the grammar engine cannot enforce are found where they are keywords,
and only there (protocol/json_schema_support.py). Pure functions."""

from __future__ import annotations

from pagedserve.protocol.json_schema_support import unenforceable


def test_keywords_are_found_at_any_depth_with_where_they_sit():
    assert "'uniqueItems' (at /$defs/tags)" in unenforceable(
        {"type": "object", "$defs": {"tags": {"type": "array", "uniqueItems": True}}})
    assert "'not' (at /properties/a/anyOf/1)" in unenforceable(
        {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"not": {"const": 3}}]}}})
    assert "lookaround" in unenforceable({"type": "object", "patternProperties": {"^(?=x)": {"type": "string"}}})
    assert "allOf" in unenforceable({"items": [{"allOf": [{"type": "integer"}, {"minimum": 1}]}]})


def test_names_and_data_that_look_like_keywords_are_not_keywords():
    schema = {"type": "object", "required": ["not", "if"],
              "properties": {"not": {"type": "integer"}, "if": {"enum": [{"contains": 1}]},
                             "x/y": {"const": {"uniqueItems": True}, "default": {"not": 1}}},
              "allOf": [{"type": "object"}], "items": {"uniqueItems": False}}
    assert unenforceable(schema) is None
