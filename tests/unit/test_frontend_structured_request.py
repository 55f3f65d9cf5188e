"""How a request body's ways of asking for structured output become the one StructuredOutputs
it sends, with pure objects: OpenAI's response_format, vLLM's structured_outputs and guided_*."""

from __future__ import annotations

import json

import pytest

from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest, CompletionRequest
from pagedserve.frontend_proc.structured_request import structured_outputs_of
from pagedserve.protocol.messages import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_each_way_of_asking_maps_to_the_same_wire_form():
    as_schema = StructuredOutputs(json=json.dumps(SCHEMA))
    assert structured_outputs_of(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": False}})) == as_schema
    assert structured_outputs_of(chat(guided_json=SCHEMA)) == as_schema
    assert structured_outputs_of(chat(guided_json=json.dumps(SCHEMA))) == as_schema
    assert structured_outputs_of(chat(structured_outputs={"json": SCHEMA})) == as_schema
    assert structured_outputs_of(chat(response_format={"type": "json_object"})) == StructuredOutputs(json_object=True)
    assert structured_outputs_of(chat(response_format={"type": "text"})) is None
    assert structured_outputs_of(chat()) is None
    completion = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["yes", "no"]})
    assert structured_outputs_of(completion) == StructuredOutputs(choice=["yes", "no"])
    completion = CompletionRequest.model_validate({"prompt": "x", "guided_grammar": 'root ::= "a" | "b"'})
    assert structured_outputs_of(completion) == StructuredOutputs(grammar='root ::= "a" | "b"')


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_regex": "[a-"}, "guided_regex", "regex cannot be compiled"),
    ({"guided_json": {"type": "objekt"}}, "guided_json", "json cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "more than once"),
])
def test_a_bad_or_ambiguous_request_is_a_400_naming_the_field(fields, param, words):
    with pytest.raises(InvalidRequest) as caught:
        structured_outputs_of(chat(**fields))
    assert caught.value.param == param and words in caught.value.message


def test_an_unknown_response_format_type_and_a_whitespace_pattern_are_refused_by_the_schema():
    with pytest.raises(ValueError):
        chat(response_format={"type": "structural_tag"})
    with pytest.raises(ValueError, match="guided_whitespace_pattern"):
        chat(guided_whitespace_pattern=r"\s*")
