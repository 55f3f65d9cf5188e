"""The documented in-process loop (tools/in_process_engine.py), run as a newcomer runs it: its
command prints transformers' greedy text for each prompt, and a refused request is an error that
names it, not a silent empty stream."""

from __future__ import annotations

import pytest

from pagedserve.protocol.messages import SamplingParams
from pagedserve.tools.in_process_engine import generate, main
from support.oracle import hf_greedy, hf_tokenizer


def test_the_command_prints_transformers_greedy_text_for_each_prompt(model_factory, capsys):
    model = model_factory("qwen2")
    prompts = ["Hello", "The cache holds"]
    assert main([model, *[arg for text in prompts for arg in ("--prompt", text)], "--max-tokens", "6"]) == 0
    tokenizer = hf_tokenizer(model)
    expected = [f"{text!r} -> {tokenizer.decode(hf_greedy(model, tokenizer.encode(text), 6))!r}" for text in prompts]
    assert capsys.readouterr().out.splitlines() == expected


def test_a_request_the_scheduler_refuses_raises_naming_it(model_factory):
    with pytest.raises(RuntimeError, match="^r1: .*"):
        generate(model_factory("qwen2"), [[1, 2, 3], list(range(1, 600))], [SamplingParams(max_tokens=2)] * 2)
