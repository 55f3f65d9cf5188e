"""Reasoning parsers: where the thinking starts and ends (vLLM's rules for qwen3 and deepseek_r1),
tool calls parsed from the content only, and a stream cut anywhere, at every byte boundary or
token by token, adding up to the full response's reasoning_content and content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.frontend_proc.reasoning import REASONING_PARSERS, get_reasoning_parser
from pagedserve.frontend_proc.reasoning.output import ReasoningChoices
from pagedserve.frontend_proc.response_format import ChatFormat
from pagedserve.frontend_proc.tool_call_output import ToolCallChoices
from pagedserve.frontend_proc.tool_parsers import TOOL_PARSERS

from support.stream_pieces import byte_cut_pieces, random_pieces, streamed, token_pieces

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
TEXTS = [
    "<think>\nLet me think: 2 + 2.\n</think>\n\nThe answer is 4.",
    "Opened by the template, so no tag here.</think>The answer.",
    "<think>Zürich, 東京 and 🙂 are in the thinking</think>and in the answer: 🚀 → π",
    "<think>never closed, cut by max_tokens",
    "no tags at all",
    "<think>a literal </thi is not the end</think>done",
    "<think></think>",
    "</think>only content",
    "<think>I might call <tool_call> later</think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
    "<think>thinking then calling\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
]


def _full(choices: ReasoningChoices, text: str) -> dict:
    return choices.full_choice(0, text, None, "stop")["message"]


def _renderer(parser, tool_parser=None) -> ReasoningChoices:
    fmt = ChatFormat("m")
    inner = fmt if tool_parser is None else ToolCallChoices(fmt, tool_parser, 1)
    return ReasoningChoices(fmt, inner, parser, 1)


def test_qwen3_thinking_is_split_from_the_answer_whether_the_model_or_the_template_opened_it():
    message = _full(_renderer(QWEN3), TEXTS[0])
    assert (message["reasoning_content"], message["content"]) == ("\nLet me think: 2 + 2.\n", "\n\nThe answer is 4.")
    message = _full(_renderer(QWEN3), TEXTS[1])
    assert (message["reasoning_content"], message["content"]) == ("Opened by the template, so no tag here.",
                                                                  "The answer.")


@pytest.mark.parametrize("parser", [QWEN3, R1])
def test_thinking_never_closed_is_all_reasoning_and_the_content_is_null(parser):
    message = _full(_renderer(parser), TEXTS[3])
    assert (message["reasoning_content"], message["content"]) == ("never closed, cut by max_tokens", None)
    assert _full(_renderer(parser), "no tags at all")["reasoning_content"] == "no tags at all"


def test_enable_thinking_false_or_a_prompt_that_closed_the_thinking_means_no_reasoning():
    assert not QWEN3.starts_in_reasoning("<|im_start|>assistant\n", {"enable_thinking": False})
    assert QWEN3.starts_in_reasoning("<|im_start|>assistant\n", {"enable_thinking": True})
    assert QWEN3.starts_in_reasoning("<|im_start|>assistant\n<think>\n", None)
    for parser in (QWEN3, R1):  # Qwen3's template writes an empty thinking block for enable_thinking false
        assert not parser.starts_in_reasoning("assistant\n<think>\n\n</think>\n\n", None)
    assert R1.starts_in_reasoning("<｜Assistant｜>", {"enable_thinking": False})  # R1 has no such switch


def test_qwen3_ends_unclosed_thinking_at_a_tool_call_that_names_a_function():
    message = _full(_renderer(QWEN3, TOOL_PARSERS["qwen3_coder"]), TEXTS[9])
    assert message["reasoning_content"] == "thinking then calling\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    # a bare mention is not a call: deepseek_r1 never ends there
    assert _full(_renderer(R1), TEXTS[9])["content"] is None


def test_tool_calls_are_parsed_from_the_content_only():
    message = _full(_renderer(QWEN3, TOOL_PARSERS["hermes"]), TEXTS[8])
    assert message["reasoning_content"] == "I might call <tool_call> later"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"] and message["content"] == "\n"
    thinking_only = _full(_renderer(QWEN3, TOOL_PARSERS["hermes"]), '<think><tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert "tool_calls" not in thinking_only  # a call written while thinking is thinking


def _expected(parser, text: str, tool_parser=None) -> dict:
    message = _full(_renderer(parser, tool_parser), text)
    calls = [c["function"] for c in message.get("tool_calls", [])]
    return {"content": message["content"] or "", "reasoning": message["reasoning_content"] or "",
            "calls": calls, "finish_reason": "tool_calls" if calls else "stop"}


def _all_cuts(text: str) -> list[list[str]]:
    cuts = [byte_cut_pieces(text, k) for k in range(1, len(text.encode()))]
    return cuts + [list(text), *[random_pieces(text, s) for s in range(5)]] if len(text) > 1 else [[text]]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_at_every_byte_boundary_adds_up_to_the_full_response(name, text):
    parser = get_reasoning_parser(name)
    for tool_parser in (None, TOOL_PARSERS["hermes"], TOOL_PARSERS["qwen3_coder"]):
        expected = _expected(parser, text, tool_parser)
        for pieces in [*_all_cuts(text), token_pieces(text)]:
            assert streamed(_renderer(parser, tool_parser), pieces) == expected, pieces


ATOMS = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", "<tool_call>", "\n", " ", "<function=f>",
         "a", "é", "東", "🙂", "</tool_call>", "{", "}", '"name"', ":", "<parameter=x>", "</function>"]


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(atoms=st.lists(st.sampled_from(ATOMS), max_size=16), data=st.data(),
       name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_any_text_cut_anywhere_parses_the_same_streamed_or_whole(atoms, data, name):
    text = "".join(atoms)
    parser = get_reasoning_parser(name)
    size = len(text.encode())
    cuts = sorted(data.draw(st.sets(st.integers(1, size - 1), max_size=6))) if size > 1 else []
    assert streamed(_renderer(parser), _whole_characters(text, cuts)) == _expected(parser, text)


def _whole_characters(text: str, byte_cuts: list[int]) -> list[str]:
    """The text cut at byte offsets, a character split by a cut arriving with the piece after."""
    ends, offset = [], 0
    for char in text:
        offset += len(char.encode())
        ends.append(offset)
    char_cuts = sorted({sum(1 for end in ends if end <= cut) for cut in byte_cuts} - {0, len(text)})
    return [text[a:b] for a, b in zip([0, *char_cuts], [*char_cuts, len(text)])]
