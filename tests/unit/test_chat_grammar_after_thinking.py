"""A chat request's grammar with a reasoning parser (chat_request.py): set to start after the
``</think>`` token when the output starts in the thinking, from the first token when the prompt
closed it, and a 400 naming the field where the tokenizer has no single ``</think>`` token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.chat_request import prepare_chat
from pagedserve.frontend_proc.errors import InvalidRequest
from pagedserve.frontend_proc.openai_schema import ChatCompletionRequest
from pagedserve.frontend_proc.reasoning import REASONING_PARSERS
from pagedserve.frontend_proc.response_format import ChatFormat
from pagedserve.frontend_proc.tool_choice import ToolCallingConfig

USER = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def thinking_tokenizer(model_factory):
    return PromptTokenizer(Path(model_factory("qwen2", thinking_template=True)))


def _prepare(tokenizer, **fields):
    body = ChatCompletionRequest(messages=USER, **fields)
    return prepare_chat(body, tokenizer, ToolCallingConfig(True, "hermes"), ChatFormat("m"), REASONING_PARSERS["qwen3"])


def test_the_grammar_starts_after_the_end_of_the_thinking(thinking_tokenizer):
    end_id = thinking_tokenizer.tokenizer.convert_tokens_to_ids("</think>")
    spec = _prepare(thinking_tokenizer, response_format=SCHEMA).structured_outputs
    assert json.loads(spec.json) == {"type": "object"} and spec.start_after == [end_id]
    forced = _prepare(thinking_tokenizer, tools=[WEATHER], tool_choice="required").structured_outputs
    assert forced.start_after == [end_id] and json.loads(forced.json)["type"] == "array"
    assert _prepare(thinking_tokenizer).structured_outputs is None


def test_with_the_thinking_off_the_grammar_starts_at_the_first_token(thinking_tokenizer):
    spec = _prepare(thinking_tokenizer, response_format=SCHEMA,
                    chat_template_kwargs={"enable_thinking": False}).structured_outputs
    assert spec.start_after == [] and json.loads(spec.json) == {"type": "object"}


def test_a_tokenizer_without_a_single_end_token_keeps_the_400_naming_the_field(model_factory):
    tokenizer = PromptTokenizer(Path(model_factory("qwen2")))  # </think> is six BPE pieces there
    with pytest.raises(InvalidRequest, match="response_format.*in 6 tokens") as refused:
        _prepare(tokenizer, response_format=SCHEMA)
    assert refused.value.param == "response_format"
    with pytest.raises(InvalidRequest, match="tool_choice") as refused:
        _prepare(tokenizer, tools=[WEATHER], tool_choice="required")
    assert refused.value.param == "tool_choice"
