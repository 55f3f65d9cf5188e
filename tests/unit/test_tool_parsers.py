"""Tool-call parsers: calls found in scripted outputs, plain text left alone, and streams cut at
any point (token by token through the demo tokenizer, or character by character) that add up
to exactly the full response."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from pagedserve.frontend_proc.response_format import ChatFormat
from pagedserve.frontend_proc.tool_call_output import ToolCallChoices
from pagedserve.frontend_proc.tool_parsers import TOOL_PARSERS, UnknownToolParser, get_tool_parser
from pagedserve.frontend_proc.tool_parsers.forced import named_call_parser, parse_call_array

from support.stream_pieces import random_pieces, streamed, token_pieces

HERMES_OUTPUT = (
    'Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
    '{"arguments": {"city": "Z\\u00fcrich \\"old town\\"", "days": [1, 2]}, "name": "get_weather"}\n'
    '</tool_call>')
LLAMA3_OUTPUT = ('<|python_tag|>{"name": "search", "parameters": {"q": "paged attention"}}; '
                 '{"name": "get_time", "parameters": {}}')
PYTHONIC_OUTPUT = '[get_weather(city="Z\u00fcrich", days=3, units=["c", "f"]), get_time(tz=None, exact=True)]'
QWEN3_CODER_OUTPUT = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich \"old\"\n"
                      "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                      "<function=get_time>\n</function>\n</tool_call>")
PLAIN_TEXTS = ["The answer is 42.", "a < b and <tool is not a call", "x <tool_call", "",
               "{not json at all", "<tool_call>\nnot json\n</tool_call>"]


def test_hermes_finds_each_call_with_its_arguments_and_the_text_before_them():
    parsed = get_tool_parser("hermes")(HERMES_OUTPUT, True)
    assert parsed.content == "Let me check both cities.\n"
    assert [c.name for c in parsed.calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments) for c in parsed.calls] == [
        {"city": "Paris", "unit": "celsius"}, {"city": 'Zürich "old town"', "days": [1, 2]}]


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_hermes_leaves_plain_or_malformed_text_alone(text):
    parsed = get_tool_parser("hermes")(text, True)
    assert parsed.content == text and parsed.calls == []


def test_llama3_json_finds_semicolon_separated_calls_and_leaves_prose_alone():
    parser = get_tool_parser("llama3_json")
    parsed = parser(LLAMA3_OUTPUT, True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("search", {"q": "paged attention"}), ("get_time", {})]
    assert parsed.content == ""
    assert parser("Paris is sunny {today}", True).content == "Paris is sunny {today}"
    assert parser('{"name": "search", "parameters": {"q": ', True).calls == []  # cut short


def test_pythonic_reads_keyword_literals_as_json_arguments_and_leaves_prose_alone():
    parser = get_tool_parser("pythonic")
    parsed = parser(PYTHONIC_OUTPUT, True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Zürich", "days": 3, "units": ["c", "f"]}), ("get_time", {"tz": None, "exact": True})]
    assert parsed.content == ""
    for text in ["[1, 2, 3] is a list", "[f(x=y)]", "[f(1)]", "Call [f(x=1)] later", "[f(x=1)] and more"]:
        assert parser(text, True).content == text and parser(text, True).calls == []


def test_qwen3_coder_types_values_by_the_tools_schema_and_keeps_the_text_before_the_calls():
    untyped = get_tool_parser("qwen3_coder")(QWEN3_CODER_OUTPUT, True)
    assert untyped.content == "I will check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in untyped.calls] == [
        ("get_weather", {"city": 'Zürich "old"', "days": 3}), ("get_time", {})]
    schemas = {"get_weather": {"city": {"type": "string"}, "days": {"type": "string"}}}
    typed = get_tool_parser("qwen3_coder", schemas)(QWEN3_CODER_OUTPUT, True)
    assert json.loads(typed.calls[0].arguments) == {"city": 'Zürich "old"', "days": "3"}
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo"
    assert get_tool_parser("qwen3_coder")(cut, True).content == cut  # cut short: content, no call


def test_forced_choice_outputs_parse_as_calls():
    array = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert [(c.name, c.arguments) for c in parse_call_array(array, True).calls] == [
        ("a", '{"x": 1}'), ("b", "{}")]
    named = named_call_parser("a")('{"x": 1}', True)
    assert (named.calls[0].name, named.calls[0].arguments, named.calls[0].complete) == ("a", '{"x": 1}', True)


def test_an_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(UnknownToolParser, match="hermes, llama3_json"):
        get_tool_parser("mistral_v9")


def _full(parser, text: str, finish: str = "stop") -> dict:
    return ToolCallChoices(ChatFormat("m"), parser, 1).full_choice(0, text, None, finish)


def _streamed(parser, pieces: list[str], finish: str = "stop") -> tuple[str, list[dict], str]:
    """Feed the pieces as a stream does; rebuild content and calls from the deltas as the
    openai client does."""
    added = streamed(ToolCallChoices(ChatFormat("m"), parser, 1), pieces, finish)
    return added["content"], added["calls"], added["finish_reason"]


_token_pieces, _random_pieces = token_pieces, random_pieces


@pytest.mark.parametrize("parser_name, text", [("hermes", HERMES_OUTPUT), ("llama3_json", LLAMA3_OUTPUT),
                                               ("pythonic", PYTHONIC_OUTPUT), ("qwen3_coder", QWEN3_CODER_OUTPUT),
                                               *[(name, t) for t in PLAIN_TEXTS if t
                                                 for name in ("hermes", "pythonic", "qwen3_coder")]])
def test_streamed_deltas_add_up_to_the_full_response_wherever_the_stream_is_cut(parser_name, text):
    parser = TOOL_PARSERS[parser_name]
    full = _full(parser, text)["message"]
    expected_calls = [c["function"] for c in full.get("tool_calls", [])]
    splits = [_token_pieces(text), list(text), *[_random_pieces(text, s) for s in range(20)]]
    for pieces in splits:
        content, calls, finish_reason = _streamed(parser, pieces)
        assert calls == expected_calls
        if calls:  # the stream cannot take back a call it announced, so compare only then
            assert (content or None) == full["content"] and finish_reason == "tool_calls"
        else:
            assert content == full["content"] == text and finish_reason == "stop"


def test_full_response_carries_calls_with_ids_null_content_and_tool_calls_finish():
    choice = _full(parse_call_array, '[{"name": "a", "arguments": {"x": 1}}]')
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "a", "arguments": '{"x": 1}'}
    cut = _full(named_call_parser("a"), '{"x": ', finish="length")
    assert cut["finish_reason"] == "length"  # cut by max_tokens: the call is incomplete


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    choices = ToolCallChoices(ChatFormat("m"), TOOL_PARSERS["hermes"], 1, parallel_tool_calls=False)
    calls = choices.full_choice(0, HERMES_OUTPUT, None, "stop")["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]


OPENAI_SCHEMA = Path(__file__).resolve().parents[3] / "shared" / "openai-openapi" / "openai_subset.json"


def test_calls_and_call_deltas_have_openai_shapes():
    if not OPENAI_SCHEMA.is_file():
        pytest.skip(f"OpenAI's schema is not at {OPENAI_SCHEMA}")
    schemas = json.loads(OPENAI_SCHEMA.read_text())["components"]["schemas"]
    parser = TOOL_PARSERS["hermes"]
    for call in _full(parser, HERMES_OUTPUT)["message"]["tool_calls"]:
        jsonschema.validate(call, schemas["ChatCompletionMessageToolCall"])
    choices = ToolCallChoices(ChatFormat("m"), parser, 1)
    deltas = [d for piece in _token_pieces(HERMES_OUTPUT)
              for d in (choices.chunk_choice(0, piece, None, None) or {"delta": {}})["delta"].get("tool_calls", [])]
    assert len(deltas) > 2
    for delta in deltas:
        jsonschema.validate(delta, schemas["ChatCompletionMessageToolCallChunk"])


@pytest.mark.parametrize("text", ['<tool_call>{"na\\qme": "f", "arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f\\q", "arguments": {}}</tool_call>',
                                  '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {]}</tool_call>'])
def test_noise_that_looks_like_a_call_is_returned_as_content(text):
    full = _full(TOOL_PARSERS["hermes"], text)
    assert (full["message"]["content"], full["finish_reason"]) == (text, "stop")
    assert "tool_calls" not in full["message"]
    if '"f"' not in text:  # no call was ever named, so the stream has nothing to take back
        assert _streamed(TOOL_PARSERS["hermes"], list(text)) == (text, [], "stop")


def test_no_output_whatever_its_noise_makes_a_parser_raise():
    rng = random.Random(0)
    atoms = ['{', '}', '[', ']', '"', ':', ',', ';', '\\', ' ', 'a', '1', '-', 'e', 'true', '"name"',
             '"arguments"', '"parameters"', '<tool_call>', '</tool_call>', '<|python_tag|>', '\\u12']
    parsers = [*TOOL_PARSERS.values(), parse_call_array, named_call_parser("f")]
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 30)))
        for parser in parsers:
            for final in (False, True):
                parser(text, final)
            if text:
                _streamed(parser, _random_pieces(text, rng.randrange(1 << 30)) if len(text) > 1 else [text])

