"""scheduler_proc/utf8_guard.py: a constrained output stays valid UTF-8 where xgrammar would let
the UTF-8 form of a surrogate (ED A0..BF xx) through, which decodes to three U+FFFD."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedserve.protocol.messages import StructuredOutputs
from pagedserve.scheduler_proc.grammar import RequestGrammar
from pagedserve.scheduler_proc.grammar_cache import CompiledGrammarCache, GrammarBackendLoader
from pagedserve.scheduler_proc.utf8_guard import Utf8Guard

VOCAB = 512
NAME = StructuredOutputs(json=json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                                          "required": ["name"]}))


def allowed(rows: np.ndarray, row: int, token: int) -> bool:
    return bool((int(rows[row, token // 32]) >> (token % 32)) & 1)


def test_the_guard_clears_surrogates_inside_a_token_and_after_a_lead_byte_only():
    vocab = [b"a", b"\xed", b"\xa0\x80", b"\x80\x80", b"x\xed\xa5y", b"", b"\xbf", b"\xed\x9f\xbf"]
    guard = Utf8Guard(vocab)
    rows = np.full((2, 2), -1, dtype=np.int32)  # a second word past the vocabulary
    guard.narrow(rows, 0, None)
    guard.narrow(rows, 1, 1)  # after b"\xed"
    assert [t for t in range(len(vocab)) if allowed(rows, 0, t)] == [0, 1, 2, 3, 5, 6, 7]
    assert [t for t in range(len(vocab)) if allowed(rows, 1, t)] == [0, 1, 3, 5, 7]
    assert (rows[:, 1] == -1).all()
    guard.narrow(rows, 0, 7)  # b"\xed\x9f\xbf" ends a whole character (U+D7FF), not in a lead
    assert allowed(rows, 0, 2)


@pytest.fixture(scope="module")
def byte_tokens(model_factory):
    """The served grammar of NAME and the test tokenizer's single-byte tokens by byte."""
    grammars = CompiledGrammarCache(GrammarBackendLoader(model_factory("qwen2")), VOCAB)
    served = grammars.compile(NAME)
    vocab = served.compiled.tokenizer_info.decoded_vocab
    return served, {t[0]: i for i, t in enumerate(vocab) if len(t) == 1}


def test_a_sampled_string_cannot_take_a_surrogate_that_xgrammar_would_count_as_one_character(byte_tokens):
    import xgrammar

    served, by_byte = byte_tokens
    prefix = [by_byte[b] for b in b'{"name": "P5\xed']
    guarded = RequestGrammar(served, frozenset()).new_matcher()
    plain = xgrammar.GrammarMatcher(served.compiled, terminate_without_stop_token=True)
    for token in prefix:
        assert guarded.accept(token) and plain.accept_token(token)
    rows = np.zeros((2, -(-VOCAB // 32)), dtype=np.int32)
    guarded.fill(rows, 0)
    plain.fill_next_token_bitmask(rows, 1)
    assert allowed(rows, 1, by_byte[0xA0])  # xgrammar alone: ED A0 is the start of a "character"
    assert not allowed(rows, 0, by_byte[0xA0]) and not allowed(rows, 0, by_byte[0xBF])
    assert allowed(rows, 0, by_byte[0x80]) and allowed(rows, 0, by_byte[0x9F])  # ED 80..9F: valid
