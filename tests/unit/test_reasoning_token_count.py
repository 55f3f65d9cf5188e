"""reasoning_tokens: the output tokens up to and including the one that ends the thinking, read
from the same split as reasoning_content, with the demo tokenizer (whose </think> is a token of
its own in a thinking model, and many BPE pieces otherwise)."""

from __future__ import annotations

import pytest

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.reasoning import REASONING_PARSERS
from pagedserve.frontend_proc.reasoning.token_count import reasoning_token_count
from pagedserve.tools.demo_model import CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE, build_tokenizer

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.fixture(scope="module", params=["think tokens", "bpe pieces"])
def tokenizer(request, tmp_path_factory):
    hf = (build_tokenizer(512, THINKING_CHAT_TEMPLATE, think_tokens=True) if request.param == "think tokens"
          else build_tokenizer(512, CHAT_TEMPLATE))
    path = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(path)
    return PromptTokenizer(path)


def _count(parser, tokenizer, thinking: str, answer: str) -> tuple[int, int, int]:
    """(counted, tokens of the thinking part alone, tokens in all); the count is the same by
    bisection alone and with the end tag's ids (their fast path, or bisection when it misses)."""
    ids = tokenizer.tokenizer.encode(thinking + answer, add_special_tokens=False)
    alone = tokenizer.tokenizer.encode(thinking, add_special_tokens=False)
    assert ids[:len(alone)] == alone  # the cases below tokenize apart at the boundary
    text = tokenizer.decode(ids)
    counted = reasoning_token_count(parser, text, ids, tokenizer)
    end_ids = tokenizer.tokenizer.encode("</think>", add_special_tokens=False)
    assert reasoning_token_count(parser, text, ids, tokenizer, end_ids) == counted
    return counted, len(alone), len(ids)


@pytest.mark.parametrize("thinking, answer", [
    ("<think>\nLet me think: 2 + 2.\n</think>", "\n\nThe answer is 4."),
    ("Opened by the template, Zürich 東京 🙂</think>", "The answer."),
    ("<think></think>", "x"),
    ("<think>a literal </thi is not the end</think>", "done"),
])
def test_the_count_ends_with_the_token_that_closes_the_thinking(tokenizer, thinking, answer):
    counted, thinking_tokens, _ = _count(QWEN3, tokenizer, thinking, answer)
    assert counted == thinking_tokens > 0
    assert _count(R1, tokenizer, thinking, answer)[0] == thinking_tokens


def test_thinking_that_never_ends_is_every_token(tokenizer):
    counted, _, total = _count(QWEN3, tokenizer, "<think>never closed, cut by max_tokens 🙂", "")
    assert counted == total > 0


def test_a_qwen3_tool_call_ends_the_thinking_where_it_starts(tokenizer):
    thinking = "<think>thinking then calling\n"
    answer = "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    counted, thinking_tokens, total = _count(QWEN3, tokenizer, thinking, answer)
    assert counted == thinking_tokens < total
    assert _count(R1, tokenizer, thinking, answer)[0] == total  # deepseek_r1: only </think> ends it
    # a </think> after the call: the tag's ids are there, but the thinking ended before them
    counted, thinking_tokens, _ = _count(QWEN3, tokenizer, thinking, answer + "</think>")
    assert counted == thinking_tokens


def test_a_token_past_the_end_tag_in_the_same_piece_counts_as_thinking(tokenizer):
    """The count includes the token that completes the end; what else that token holds is
    content, but the token cannot be split."""
    ids = tokenizer.tokenizer.encode("<think>ok</think>The", add_special_tokens=False)
    text = tokenizer.decode(ids)
    counted = reasoning_token_count(QWEN3, text, ids, tokenizer)
    assert len(tokenizer.decode(ids[:counted])) >= text.index("</think>") + len("</think>")
    assert len(tokenizer.decode(ids[:counted - 1])) < text.index("</think>") + len("</think>")
